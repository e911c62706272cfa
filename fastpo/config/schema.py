"""Training configuration: dataclasses with the paper's defaults, presets, YAML and dotted overrides.

The schema is a tree of dataclasses (`TrainConfig` at the root). Defaults are the RAGEN
paper's (arXiv 2504.20073, Sec. 5 and App. B): 8 env
groups x 16 trajectories, 5 turns, 10 actions, PPO mini-batch 32, GAE gamma = lambda = 1,
entropy coefficient 0.001, actor lr 1e-6, critic lr 1e-5, grad clip 1.0, 200 iterations,
eval on 256 fixed seeds at temperature 0.5 every 10 iterations, StarPO-S (top-25% reward-std
filtering, no KL, clip-higher 0.2 / 0.28).

A configuration is built in layers, each validated before any model loads:

    defaults -> named preset (paper | cpu | starpo | grpo ...) -> environment preset
             -> YAML file -> dotted command-line overrides (``algorithm.adv_estimator=grpo``)

`load_config` does all of it; errors are `ConfigError` (a `ValueError`) naming the key.

This module holds the schema, the cross-field checks (`validate`) and `load_config`; the
field machinery (rules, type checks, overrides, merging) is in fastpo.config.fields, the named
presets in fastpo.config.presets, reading and writing config files in fastpo.config.files. The
package `fastpo.config` exports the public names.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Optional

# The field machinery (fastpo.config.fields), the presets (fastpo.config.presets) and the YAML files
# (fastpo.config.files) live in their own modules: import their names from there.
from fastpo.config.fields import (FLOAT32_MAX, ConfigError, Rule, as_dict, nested_dict, apply_dict, check_fields,
                                  checked, flat_settings, key, parse_override, section_items)
from fastpo.config.files import dig, parse_config_yaml, read_config_file
from fastpo.config.imitation import (OPTIONAL_SECTIONS, DaggerConfig, SFTConfig, add_sections, apply_legacy_sections,
                                     check_imitation, check_sections, refuse_sections)
from fastpo.config.presets import PRESETS, default_preset
from fastpo.registry import ESTIMATOR_NAMES, LOSS_AGGREGATION_NAMES, estimator

#: Upper bound on rollout.max_actions_per_turn (the paper uses 5; more only pads the prompt).
MAX_ACTIONS_PER_TURN = 64

# Sampling rules shared by the rollout config and the engine's SamplingParams.
TOP_P_RULE = Rule(lambda v: 0 < v <= 1, "must be in (0, 1]")
TOP_K_RULE = Rule(lambda v: v >= 0, "must be >= 0 (0 = off)")


def _policy_losses():
    """fastpo.kernels.losses: the registered policy losses with their facts and settings. Imported
    on first use, not at the top: a loss is a torch function registered beside its facts, and
    `import fastpo.config` loads no torch (validating a config does, as it has to)."""
    from fastpo.kernels import losses

    return losses


def _policy_loss_names() -> tuple[str, ...]:
    return tuple(_policy_losses().POLICY_LOSSES)


def _policy_loss_settings() -> dict:
    """The registered losses' own settings (the keys of `AlgorithmConfig.loss_settings`); one
    named like an algorithm key would be read as that key, so it is refused here."""
    declared = _policy_losses().loss_settings()
    taken = [n for n in declared if n in AlgorithmConfig.__dataclass_fields__]
    if taken:
        raise ConfigError(f"a registered policy loss takes a setting named {taken[0]!r}, which is the config key "
                          f"'algorithm.{taken[0]}' already: give the setting another name")
    return declared


def at_least(n: int) -> Callable[[Any], bool]:
    return lambda v: v >= n


def _window_ok(value: Any) -> bool:
    """rollout.context_window: "full" or an int K >= 1 (the type is checked before)."""
    return value == "full" if isinstance(value, str) else (not isinstance(value, bool) and value >= 1)


CONTEXT_WINDOW_WHY = "must be 'full' or an integer K >= 1 (the last K turns kept)"


def _in_unit(v: Any) -> bool:
    return 0 <= v <= 1


def _seed_range(v: Any) -> bool:  # env and torch seeds are 32-bit
    return 0 <= v < 2**32


@dataclass
class ModelConfig:
    """The `model` section: which policy model to train, and how (full weights or LoRA)."""

    name: str = checked(
        "smollm2-135m-instruct", bool, "must not be empty",
        doc='the model: "smollm2-135m-instruct" (embedded, the default), an HF hub id, a local model folder, a '
            'fastpo checkpoint or run folder, or "random:<shape>" (a known architecture with random weights: '
            "tiny-llama, smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b; fastpo.models).")
    dtype: Literal["auto", "float32", "bfloat16"] = key(
        "auto",
        doc='"auto" (fp32 on the CPU, bf16 on CUDA), "float32" or "bfloat16".')
    gradient_checkpointing: bool = key(False, doc="recompute activations in the backward pass (less memory).")
    lora_rank: int = checked(
        0, at_least(0), "must be >= 0 (0 = full fine-tuning)",
        doc="> 0 trains LoRA adapters of this rank through peft instead of the full weights (0 = full fine-tuning).")
    lora_alpha: int = checked(
        16, lambda v: v > 0, "must be > 0",
        doc="LoRA's scaling numerator (the adapters are scaled by alpha / rank).")
    lora_dropout: float = checked(
        0.0, lambda v: 0 <= v < 1, "must be in [0, 1)",
        doc="dropout on the LoRA adapters' input.")
    lora_target_modules: list = key(
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        doc="the module names that get LoRA adapters (peft's rule: a layer whose name is one of them or ends with "
            '"." + one); a name that matches no linear or embedding layer of the model is refused in one line once '
            "it loads (exit 2).")


@dataclass
class EnvConfig:
    """The `env` section: the game (or a mixture of games) and how it is stepped."""

    name: str = checked(
        "frozenlake", lambda v: bool(v.strip()), "must name an environment",
        doc="the game: a built-in one (bandit, sokoban, frozenlake; docs/environments.md), a plain-Python game as "
            '"module.path:Class", "textarena:ID", "gym:ID" or the name of an installed `fastpo.envs` entry point '
            "(docs/custom_environments.md); checked through `fastpo.envs` before any model loads.")
    options: dict = key(
        factory=dict,
        doc="the game's constructor arguments, e.g. `{size: 8, num_boxes: 2}` for Sokoban or `{p: 0.9, success_prob: "
            "0.8}` for FrozenLake.")
    workers: int = checked(
        0, at_least(0), "must be >= 0 (0 = in process)",
        doc="> 0 steps a plain-Python game in that many worker processes (same results as in process); 0 steps it in "
            "the trainer's process. Built-in games ignore it.")
    mixture: list = key(
        factory=list,
        doc='several games in one run (name is then "mixture"): a list of entries `{name, weight, options, settings, '
            "label}` (fastpo.envs.mixture); each env group plays one of them, drawn by weight from its env seed, and "
            "each is evaluated on its own (`eval/<label>/...`). `--env a,b` is a mixture of a and b at weight 1.")


@dataclass
class RewardConfig:
    """The `reward` section: a reward of your own (a function, an LLM judge) beside or instead of
    the game's (fastpo.rewards)."""

    fn: Optional[str] = key(
        None,
        doc='null, or "module.path:function" scoring each finished training trajectory (a fastpo.rewards.Trajectory) '
            "with a float (on its last turn) or one float per turn; imported and checked before any model loads.")
    mode: Literal["add", "replace"] = key(
        "add",
        doc='"add" (to the game\'s turn rewards) or "replace" (the game\'s turn rewards; the format penalty stays); '
            "applies to the sum of reward.fn's value and the judge's.")
    judge_rubric: Optional[str] = key(
        None,
        doc="null, or the LLM judge's rubric (fastpo.judge): its user message, holding {answer} or {transcript} "
            "(also {task}, {env}, {final}); the judge's score in [0, 1] goes on each training trajectory's last turn.")
    judge_rubric_file: Optional[str] = key(
        None,
        doc="null, or a UTF-8 file holding the rubric (instead of judge_rubric); read and checked before any model "
            "loads, and kept as judge_rubric's text in the run's config.yaml (a resume does not read the file again).")
    judge_model: Optional[str] = key(
        None,
        doc="the judge model: null (the policy's starting weights, a frozen copy) or any model.name value (HF id, "
            "folder, run folder, random:<shape>).")
    judge_scale: Literal["yes_no", "number"] = key(
        "yes_no",
        doc='"yes_no" (a yes scores 1, a no 0) or "number" (the reply\'s first number in [judge_min, judge_max], '
            "scaled to [0, 1]).")
    judge_min: float = key(0.0, doc="the number scale's lowest score.")
    judge_max: float = key(10.0, doc="the number scale's highest score (above judge_min).")
    judge_fallback: float = checked(
        0.0, lambda v: math.isfinite(v), "must be a finite number",
        doc="the score of a reply without a verdict (counted in train/judge_unparsed_rate).")
    judge_max_new_tokens: int = checked(
        8, at_least(1), "must be >= 1",
        doc="the judge's reply length cap (greedy decoding).")
    judge_batch_size: int = checked(
        16, at_least(1), "must be >= 1",
        doc="prompts per judge engine batch (bounds its KV cache).")


@dataclass
class RolloutConfig:
    """Multi-turn rollout settings (defaults: the paper / RAGEN's); the `rollout` section adds
    the batch shape (RolloutSection)."""

    max_turns: int = checked(5, at_least(1), "must be >= 1", doc="turns per trajectory (the paper's 5).")
    max_actions_per_turn: int = checked(
        5, lambda v: 1 <= v <= MAX_ACTIONS_PER_TURN, f"must be >= 1 and <= {MAX_ACTIONS_PER_TURN}",
        doc="actions read from one answer (5); extra ones are ignored, not penalised.")
    max_actions_per_traj: int = checked(
        10, at_least(1), "must be >= 1",
        doc="action budget of a trajectory (10); it ends when spent.")
    max_new_tokens: int = checked(400, at_least(1), "must be >= 1", doc="response tokens per turn (400).")
    max_context: int = checked(
        3600, at_least(1), "must be >= 1",
        doc="tokens per trajectory (3600); a trajectory that would pass it ends truncated.")
    temperature: float = checked(
        1.0, lambda v: v > 0, "must be > 0 (the logits are divided by it)",
        doc="sampling temperature; it scales the logits, and the recorded log-probs and the trainer's loss are at "
            "this temperature (greedy decoding is the engine's SamplingParams(temperature=0), not a rollout setting).")
    top_p: float = checked(1.0, TOP_P_RULE.ok, TOP_P_RULE.why, doc="nucleus sampling mass (1 = off).")
    top_k: int = checked(0, TOP_K_RULE.ok, TOP_K_RULE.why, doc="sample among the k likeliest tokens (0 = off).")
    think: bool = key(
        True,
        doc='prime the response with "<think>" (True) or the answer-only variant primed with "<answer>".')
    format_penalty: float = checked(
        -0.1, lambda v: v <= 0, "must be <= 0",
        doc="added to a turn's reward when its answer is missing or holds an invalid action (-0.1).")
    format_rule: Literal["ragen", "strict"] = checked(
        "ragen",
        doc='what counts as an answer (rollout/parsing.py): "ragen" is RAGEN\'s rule, the first think/answer pattern '
            'found anywhere in the response (none found: no action runs); "strict" also penalises any response that '
            "is not exactly the pattern.")
    run_valid_actions_on_format_error: bool = key(
        True,
        doc="in a penalised turn, still execute the valid actions of the answer found (what RAGEN does with an "
            "answer holding an invalid action); False executes nothing.")
    stop_at_answer_close: bool = key(
        True,
        doc='end a response at "</answer>" (the template\'s end-of-turn token is then appended, loss mask 0; RAGEN '
            "generates on to the end-of-turn token).")
    system_prompt: str | None = key(
        None,
        doc="the system prompt; null for prompts.SYSTEM_PROMPT (SYSTEM_PROMPT_NO_THINK when think is False).")
    feedback_invalid: bool = key(True, doc="tell the model which actions were invalid in the next user message.")
    prompt_examples: bool = key(
        False,
        doc="in answer-only mode, end every user message with a question and three answers in the exact format, "
            "built from the game's action names (prompts.move_question), instead of RAGEN's \"<answer> [your answer] "
            '</answer>" reminder; no effect with think=True. The CPU preset turns it on (docs/results.md).')
    context_window: int | str = checked(
        "full", _window_ok, CONTEXT_WINDOW_WHY,
        doc='"full" (every turn stays in the context) or K >= 1: the last K turns (user observation + response) '
            "kept, the system prompt and the first user message always kept; RAGEN's `limited_multi_turn` with "
            "`max_context_window: K`. fastpo evicts the dropped turns' KV entries and keeps positions "
            "(fastpo/rollout/window.py).")

    #: how `check_fields` names this class's fields in its errors
    KEY_PREFIX: ClassVar[str] = "RolloutConfig."

    def __post_init__(self) -> None:
        check_fields(self, self.KEY_PREFIX)


def context_window_turns(value: Any, owner: str = "'rollout.context_window'") -> int | None:
    """None for "full", else the number of kept turns K (an int >= 1).

    Raises ValueError naming `owner` and the value for anything else (0, negatives, floats,
    bools, strings other than "full").
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not _window_ok(value):
        raise ValueError(f"{owner} = {value!r}: {CONTEXT_WINDOW_WHY}")
    return None if value == "full" else int(value)


@dataclass
class RolloutSection(RolloutConfig):
    """The `rollout` section of a training config: every RolloutConfig option (one place for
    their defaults and meaning) plus the batch shape, the generation backend and off-policy
    data (RAGEN's rollout frequency and replay, arXiv 2504.20073)."""

    env_groups: int = checked(
        8, at_least(1), "must be >= 1",
        doc="initial states per iteration (the paper's P = 8 env groups).")
    group_size: int = checked(
        16, at_least(1), "must be >= 1",
        doc="trajectories sampled per env group (the paper's N = 16).")
    engine: Literal["native", "sglang"] = key(
        "native",
        doc='"native" (fastpo\'s sampler on the trained module itself) or "sglang" (an `sglang.Engine` holding a '
            'bf16 copy of the weights, refreshed after each update; CUDA only, `pip install "fastpo[sglang]"`).')
    sampling_streams: Literal["auto", "batch", "group"] = key(
        "auto",
        doc='"batch" draws the whole rollout batch from one random stream; "group" gives each env group its own '
            "stream seeded from (iteration, group), so a group samples the same tokens however the batch is split "
            'over processes (native engine); "auto": batch with one process, group with several. One process and N '
            'sample the same trajectories only with "group".')
    sglang_mem_fraction: float = checked(
        0.4, lambda v: 0 < v < 1, "must be in (0, 1)",
        doc="share of the GPU memory SGLang takes for its weights and KV cache (released while training).")
    reuse: int = checked(
        1, at_least(1), "must be >= 1 (1 = a fresh rollout batch every iteration)",
        doc='K >= 1 trains K consecutive iterations on one rollout batch ("Online-K"; 1 = a fresh batch every '
            "iteration), its old log-probs staying those of the policy that sampled it.")
    replay: int = checked(
        0, at_least(0), "must be >= 0 rollout batches (0 = no replay buffer)",
        doc="N >= 0 keeps the trajectories of the last N rollout batches (with their sampler log-probs; "
            "fastpo.trainer.replay) for mixing into later updates (0 = no buffer).")
    replay_fraction: float = checked(
        0.5, lambda v: 0 <= v <= 1, "must be in [0, 1] (replayed trajectories per update, as a fraction of the "
        "fresh batch)",
        doc="replayed trajectories mixed into each update, as a fraction of the fresh batch (round(fraction x batch "
            "size)).")

    KEY_PREFIX: ClassVar[str] = "rollout."

    def rollout_config(self, **changes: Any) -> RolloutConfig:
        """The plain RolloutConfig of this section (batch shape dropped), with `changes` applied."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(RolloutConfig)}
        kw.update(changes)
        return RolloutConfig(**kw)


@dataclass
class AlgorithmConfig:
    """The `algorithm` section: StarPO / StarPO-S settings: advantages, rollout filtering, the
    policy loss and its clipping, KL, the critic."""

    adv_estimator: Literal[ESTIMATOR_NAMES] = key(  # fastpo.registry.ESTIMATORS
        "gae",
        doc='"gae" (PPO with a critic), "grpo" ((R - mean)/(std + 1e-6) per env group), "drgrpo" (R - mean, no std '
            'division; Dr.GRPO), "rloo" (R minus the mean of the group\'s other trajectories; RLOO), "reinforce_pp" '
            "(each model token's discounted return, normalised over the batch; REINFORCE++) or "
            '"reinforce_pp_baseline" (R - group mean, normalised over the batch\'s tokens), or "bilevel_gae" '
            "(RAGEN's bi-level GAE with a critic: a GAE over turns with `high_level_gamma`, then one inside each "
            'turn), or "turn_rloo" (turn-level credit without a critic: each turn\'s reward-to-go minus the '
            "leave-one-out mean of the group's rewards-to-go at that turn; use reward_position=turn); "
            "fastpo.algorithms.advantages.")
    gamma: float = checked(1.0, _in_unit, "must be in [0, 1]", doc="discount over model tokens (GAE, REINFORCE++).")
    lam: float = checked(1.0, _in_unit, "must be in [0, 1]", doc="GAE's lambda.")
    high_level_gamma: float = checked(
        0.95, _in_unit, "must be in [0, 1]",
        doc="bilevel_gae's discount over turns (RAGEN's `high_level_gamma`, 0.95); `gamma` is then its discount over "
            "the tokens inside a turn.")
    reward_position: Literal["last_token", "turn"] = key(
        "last_token",
        doc='where a trajectory\'s reward sits for GAE: "last_token" (the last model token of the trajectory, the '
            "paper's default) or \"turn\" (each turn's reward on that turn's last model token).")
    whiten_advantages: bool = key(True, doc="normalise GAE's advantages over the batch's model tokens.")
    filter_mode: Literal["top", "bottom", "none", "dynamic"] = key(
        "top",
        doc='StarPO-S rollout filtering: "top" keeps the `filter_ratio` of env groups with the highest in-group '
            'reward std, "bottom" the lowest, "none" keeps all; "dynamic" is DAPO\'s dynamic sampling: env groups '
            "whose rewards do not vary are dropped and more are drawn (fresh seeds) until `rollout.env_groups` of "
            "them vary or `dynamic_max_draws` rollouts were made.")
    dynamic_max_draws: int = checked(
        3, at_least(1), "must be >= 1",
        doc="filter_mode=dynamic's cap: rollouts of `rollout.env_groups` groups per iteration, the first included "
            "(verl's max_num_gen_batches); with fewer varying groups by then the update trains on those.")
    filter_ratio: float = checked(
        0.25, lambda v: 0 < v <= 1, "must be in (0, 1]",
        doc="the filter strategy's number (top_k: the share of groups kept).")
    filter_strategy: Literal["top_k", "top_p", "min_p"] = key(
        "top_k",
        doc="RAGEN head's rollout filters (fastpo/algorithms/filtering.py): \"top_k\" (the paper's: int(filter_ratio "
            'x groups), at least 1), "top_p" (the groups whose stds make up `filter_ratio` of the total), "min_p" '
            "(std >= filter_ratio x the best).")
    filter_top_p_mode: Literal["linear", "softmax"] = key(
        "linear",
        doc='top_p\'s measure: "linear" (stds, with slack `filter_eps`) or "softmax" (softmax mass of the stds).')
    filter_eps: float = checked(
        0.01, at_least(0), "must be >= 0",
        doc="top_p linear's slack (RAGEN's `rollout_filter_selection_eps`).")
    filter_keep_zero_std: bool = key(True, doc="false drops groups without reward spread first.")
    soft_advantage_reweight: bool = key(
        False,
        doc="scale each trajectory's advantages by its group's reward std / the batch's largest group std (RAGEN "
            "head), with or without filtering.")
    overlong_buffer: int = checked(
        0, at_least(0), "must be >= 0 (0 = no overlong reward shaping)",
        doc="DAPO's overlong reward shaping (0 = off): a response (one turn) longer than rollout.max_new_tokens - "
            "overlong_buffer tokens gets a reward of -overlong_penalty_factor * (its excess / overlong_buffer), down "
            "to -overlong_penalty_factor at the limit, on that turn.")
    overlong_penalty_factor: float = checked(1.0, at_least(0), "must be >= 0", doc="the shaping's largest penalty.")
    overlong_filter: bool = key(
        False,
        doc="DAPO's overlong filtering: a turn whose response stopped at rollout.max_new_tokens leaves the loss (the "
            "trajectory's other turns stay).")
    policy_loss: str = key(
        "ppo", choices=_policy_loss_names,
        doc="the policy-gradient term, a registered policy loss (fastpo.kernels.POLICY_LOSSES: the built-in ones "
            "with their equations in docs/algorithms.md, or one of your own, `fastpo.kernels.register_policy_loss`, "
            "registered before the config loads). dual_clip applies to the losses that take it; the keys below it to "
            "their own loss.")
    loss_settings: dict = flat_settings(
        _policy_loss_settings,
        doc="every registered policy loss's own settings by name (the rows that follow `algorithm.policy_loss`): "
            "each a key of this section itself (`algorithm.sapo_tau_pos=1.2`), declared with its loss "
            "(fastpo.kernels.LossSetting: default, rule, meaning), also read and set as an attribute "
            "(`algorithm.sapo_tau_pos`).")
    clip_low: float = checked(
        0.2, lambda v: v > 0, "must be > 0",
        doc="PPO's lower clip bound (ratio >= 1 - clip_low; < 1). With policy_loss=cispo the IS weight's lower "
            "bound, and >= 1 means none (CISPO's paper sets none).")
    clip_high: float = key(
        0.28,
        doc="PPO's upper clip bound (ratio <= 1 + clip_high; clip-higher when above clip_low; >= clip_low but with "
            "cispo).")
    dual_clip: Optional[float] = checked(
        3.0, lambda v: v is None or v > 1, "must be > 1 or null",
        doc="dual-clip bound on the loss for negative advantages (null = off).")
    entropy_coef: float = checked(
        0.001, at_least(0), "must be >= 0",
        doc="weight of the entropy bonus in the policy loss.")
    kl_coef: float = checked(
        0.0, at_least(0), "must be >= 0",
        doc="> 0 penalises KL to a frozen reference model (plain StarPO).")
    kl_estimator: Literal["k1", "k3"] = key("k1", doc='the KL estimator, "k1" or "k3".')
    kl_in_reward: Optional[bool] = key(
        None,
        doc="true puts the KL penalty per token on the reward before the advantages (verl's `apply_kl_penalty`, r_t "
            "- kl_coef * kl_t, what RAGEN's PPO runs did); false adds + kl_coef * kl_t to the policy loss (what its "
            "GRPO runs did); null picks the reward for gae and reinforce_pp and the loss for the group estimators.")
    loss_agg: Optional[Literal[LOSS_AGGREGATION_NAMES]] = key(  # fastpo.registry.LOSS_AGGREGATIONS
        None,
        doc="how token losses become the mini-batch loss; null (the default) takes the one the advantage estimator's "
            "paper pairs with it (fastpo.registry's Estimator `loss_agg`; `TrainConfig.loss_agg`): "
            "\"seq-mean-token-mean\", the RAGEN paper's objective (1/G) sum_i (1/|tau_i|) sum_t (each trajectory's "
            "token mean, then the mean over trajectories), for every estimator but drgrpo, which takes "
            '"seq-mean-token-sum-norm": sum_i sum_t / (G C), no per-trajectory 1/|tau_i| and a constant C '
            '(`loss_scale_factor`; Dr.GRPO, arXiv 2503.20783). "token-mean" (verl\'s default) divides by all tokens '
            'of the mini-batch; "seq-mean-token-sum" sums each trajectory\'s tokens.')
    loss_scale_factor: Optional[int] = checked(
        None, lambda v: v is None or v >= 1, "must be >= 1 or null",
        doc='the constant C of "seq-mean-token-sum-norm" in tokens; null = rollout.max_new_tokens x '
            "rollout.max_turns, the most model tokens a trajectory can hold (Dr.GRPO's code divides by the "
            "generation budget).")
    old_logprob: Literal["recompute", "sampler", "auto"] = key(
        "auto",
        doc='PPO\'s old log-probs "recompute"d by the trainer after the rollout, taken from the "sampler", or '
            '"auto": the sampler\'s exactly when they are the same quantity (native engine on the trained fp32 '
            "module; fastpo.trainer.old_logprob).")
    ratio_level: Literal["token", "sequence"] = key(
        "token",
        doc='PPO\'s per-token ratio ("token") or GSPO\'s sequence ratio ("sequence", arXiv 2507.18071: exp of the '
            "mean token log-ratio of a trajectory, clipped per trajectory).")
    is_correction: Literal["none", "tis", "mis"] = key(
        "none",
        doc='importance-sampling correction of the sampler -> trainer gap (fastpo.algorithms.correction): "none", '
            '"tis" (weight min(rho, is_cap), rho = pi_old / pi_sampler) or "mis" (weight rho, units whose rho leaves '
            "[1/is_cap, is_cap] dropped from the loss).")
    is_level: Literal["token", "sequence"] = key(
        "token",
        doc='the correction\'s unit: "token" or "sequence" (one rho per trajectory).')
    is_cap: float = checked(
        2.0, lambda v: v > 1, "must be > 1 (importance weights are truncated at is_cap, and mis keeps [1/is_cap, "
        "is_cap])",
        doc="the correction's truncation bound.")
    # critic (PPO only)
    critic: Literal["separate", "shared"] = key(
        "separate",
        doc='PPO\'s critic: "separate" (its own model) or "shared" (a value head on the policy\'s trunk).')
    value_clip: float = checked(
        0.5, lambda v: v > 0, "must be > 0",
        doc="the value loss's clip range around the old values.")
    value_coef: float = checked(0.5, at_least(0), "must be >= 0", doc="weight of the value loss (shared critic).")
    value_loss_agg: Literal[LOSS_AGGREGATION_NAMES] = key(
        "token-mean",
        doc="the critic's clipped value loss aggregated like `loss_agg` (the same function, "
            'fastpo.kernels.aggregate); "token-mean" by default: over all model tokens of the mini-batch.')

    def __getattr__(self, name: str) -> Any:
        # a registered loss's own setting as an attribute (cfg.algorithm.sapo_tau_pos), held in loss_settings
        held = self.__dict__.get("loss_settings")
        if held is not None and not name.startswith("_"):
            if name in held:
                return held[name]
            declared = _policy_losses().loss_settings().get(name)  # registered after this config was built
            if declared is not None:
                return declared.default
        raise AttributeError(f"'AlgorithmConfig' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dataclass_fields__ or name.startswith("_") or name not in _policy_losses().loss_settings():
            object.__setattr__(self, name, value)
        else:
            self.loss_settings[name] = value


@dataclass
class OptimConfig:
    """The `optim` section: the optimizer and the update schedule."""

    actor_lr: float = checked(1e-6, lambda v: v > 0, "must be > 0", doc="the policy's AdamW learning rate.")
    critic_lr: float = checked(1e-5, lambda v: v > 0, "must be > 0", doc="a separate critic's AdamW learning rate.")
    weight_decay: float = checked(0.01, at_least(0), "must be >= 0", doc="AdamW's weight decay.")
    betas: list = key(factory=lambda: [0.9, 0.999], doc="AdamW's betas.")
    grad_clip: float = checked(1.0, lambda v: v > 0, "must be > 0", doc="gradient-norm clip.")
    ppo_epochs: int = checked(1, at_least(1), "must be >= 1", doc="passes over the batch per iteration.")
    mini_batch_size: int = checked(32, at_least(1), "must be >= 1", doc="trajectories per optimizer step.")
    micro_token_budget: int = checked(
        8192, at_least(16), "must be >= 16 tokens",
        doc="tokens per packed micro-batch (forward and backward at once).")
    share_prefix: bool = key(
        True,
        doc="pack an env group's members after one copy of their common prompt (fastpo.packing.shared_prefixes): the "
            "same log-probs and gradients, less compute.")


@dataclass
class TrainerSection:
    """The `trainer` section: loop length, evaluation, logging, checkpoints, Echo-Trap warning."""

    iterations: int = checked(200, at_least(1), "must be >= 1", doc="training iterations (updates) of the run.")
    seed: int = checked(
        0, _seed_range, "must be in [0, 2**32)",
        doc="the run's seed; every random stream derives from it (fastpo.seeds).")
    device: str = checked(
        "auto", lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None, "must be auto, cpu or cuda[:N]",
        doc='"auto" (CUDA when available), "cpu" or "cuda[:N]".')
    output_dir: str = key("", doc="the run folder (empty: runs/<env>, or --out).")
    eval_every: int = checked(
        10, at_least(0), "must be >= 0 (0 = never)",
        doc="evaluate every N iterations and at the end (0 = never).")
    eval_seeds: int = checked(256, at_least(1), "must be >= 1", doc="fixed initial states the evaluation plays.")
    eval_seed_offset: int = checked(
        1_000_000, _seed_range, "must be in [0, 2**32)",
        doc="the first eval seed (eval seeds are offset, offset + 1, ...).")
    eval_temperature: float = checked(
        0.5, lambda v: v > 0, "must be > 0",
        doc="sampling temperature of the evaluation.")
    eval_group_size: int = checked(1, at_least(1), "must be >= 1", doc="samples per eval seed (pass@k).")
    eval_before_training: bool = key(False, doc="also evaluate before the first update (iteration 0).")
    save_every: int = checked(
        10, at_least(0), "must be >= 0 (0 = only at the end)",
        doc="write a checkpoint every N iterations (0 = only at the end).")
    keep_checkpoints: int = checked(
        2, at_least(1), "must be >= 1",
        doc="intact checkpoints kept (the oldest and any damaged one pruned).")
    num_samples: int = checked(
        4, at_least(0), "must be >= 0",
        doc="decoded eval trajectories written to samples/ per evaluation.")
    ema_decay: float = checked(
        0.9, lambda v: 0 < v < 1, "must be in (0, 1)",
        doc="decay of the EMA copies of every metric (ema/...).")
    tensorboard: bool = key(False, doc="mirror the metrics to TensorBoard (the `tensorboard` extra).")
    wandb: bool = key(False, doc="mirror the metrics to Weights & Biases.")
    plots: bool = key(True, doc="draw plots/*.png.")
    echo_trap_drop: float = checked(
        0.5, lambda v: 0 < v < 1, "must be in (0, 1)",
        doc="the Echo-Trap warning fires when reward std and rollout entropy (or the collapse metrics) have fallen "
            "by this share of their early values.")
    echo_trap_window: int = checked(
        5, at_least(1), "must be >= 1",
        doc='the first N iterations, whose means are the warning\'s "early" values.')
    collapse_every: int = checked(
        5, at_least(0), "must be >= 0 (0 = never)",
        doc="mutual-information collapse metrics (fastpo/trainer/collapse.py) at iteration 1 and every N-th (0 = "
            "off).")
    kernel_impl: str = checked(
        "auto", lambda v: v in ("auto", "reference", "chunked", "triton"), "must be auto, reference, chunked or triton",
        doc='the fused loss\'s path: "auto" (Triton on CUDA, chunked elsewhere), "reference", "chunked" or "triton".')
    progress: bool = key(True, doc="show the progress bar.")
    data_parallel: str = checked(
        "fsdp", lambda v: v in ("replicate", "fsdp"), "must be fsdp or replicate",
        doc='several processes (torchrun) only: "fsdp" (FSDP2 shards the trained modules\' parameters, gradients and '
            'optimizer state over the ranks) or "replicate" (every rank holds them whole; summed gradients, '
            "DDP-style).")


@dataclass
class TrainConfig:
    """The root of the configuration tree: the preset names and one field per section."""

    preset: str = key("paper", doc="the named presets applied, comma-separated (set by --preset).")
    model: ModelConfig = key(factory=ModelConfig, doc="the `model` section (ModelConfig).")
    env: EnvConfig = key(factory=EnvConfig, doc="the `env` section (EnvConfig).")
    reward: RewardConfig = key(factory=RewardConfig, doc="the `reward` section (RewardConfig).")
    rollout: RolloutSection = key(factory=RolloutSection, doc="the `rollout` section (RolloutSection).")
    algorithm: AlgorithmConfig = key(factory=AlgorithmConfig, doc="the `algorithm` section (AlgorithmConfig).")
    optim: OptimConfig = key(factory=OptimConfig, doc="the `optim` section (OptimConfig).")
    trainer: TrainerSection = key(factory=TrainerSection, doc="the `trainer` section (TrainerSection).")
    sft: Optional[SFTConfig] = key(
        None,
        doc="the `sft` section (SFTConfig, fastpo.config.imitation): what `fastpo sft` and `fastpo dagger` train on; "
            "null (and not in config.yaml) for the other commands.")
    dagger: Optional[DaggerConfig] = key(
        None,
        doc="the `dagger` section (DaggerConfig): `fastpo dagger`'s rounds; null for the other commands.")

    def to_dict(self) -> dict:
        """The configuration as nested dicts, as config.yaml holds it (the policy losses' own
        settings as keys of `algorithm`, `flat_settings`); an optional section the run does not
        have (`sft`, `dagger`) is left out."""
        d = as_dict(self)
        for name in OPTIONAL_SECTIONS:
            if d[name] is None:
                del d[name]
        return d

    @property
    def kept_groups(self) -> int:
        """Env groups left after StarPO-S filtering, at most: int(ratio x groups) (at least 1)
        for the top_k strategy; all of them for top_p and min_p, whose count depends on the
        batch, and with group_size 1, where in-group std is undefined and filtering is skipped."""
        a = self.algorithm
        if self.rollout.group_size == 1 or a.filter_strategy != "top_k":
            return self.rollout.env_groups
        from fastpo.algorithms.filtering import kept_group_count  # the filter's rule, owned there

        return kept_group_count(self.rollout.env_groups, a.filter_mode, a.filter_ratio)

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL penalty (kl_coef > 0) goes on the reward (True) or into the loss:
        `algorithm.kl_in_reward`, or when null, True for the token-level estimators (gae,
        reinforce_pp) and False for the group ones (grpo, drgrpo, rloo, reinforce_pp_baseline)."""
        a = self.algorithm
        if a.kl_in_reward is None:
            return estimator(a.adv_estimator).token_level
        return bool(a.kl_in_reward)

    @property
    def loss_agg(self) -> str:
        """The policy loss's aggregation: `algorithm.loss_agg`, or when null the one the
        advantage estimator's paper pairs with it (fastpo.registry's Estimator `loss_agg`:
        "seq-mean-token-sum-norm" for drgrpo, "seq-mean-token-mean" for the others)."""
        a = self.algorithm
        return a.loss_agg if a.loss_agg is not None else estimator(a.adv_estimator).loss_agg

    @property
    def loss_norm(self) -> int:
        """The constant C (tokens) of the "seq-mean-token-sum-norm" aggregation:
        `algorithm.loss_scale_factor`, or rollout.max_new_tokens x rollout.max_turns."""
        f = self.algorithm.loss_scale_factor
        return int(f) if f is not None else self.rollout.max_new_tokens * self.rollout.max_turns

    @property
    def train_batch_size(self) -> int:
        """Trajectories per iteration after filtering."""
        return self.kept_groups * self.rollout.group_size


# ---------------------------------------------------------------------------------------------
# The evaluation's horizon and seeds
# ---------------------------------------------------------------------------------------------


def eval_horizon(rollout_cfg) -> int:
    """The most actions one evaluation episode can take: turns x actions per turn, capped by
    the actions per trajectory (rollout_cfg: a RolloutConfig or the `rollout` section)."""
    r = rollout_cfg
    return int(min(r.max_turns * r.max_actions_per_turn, r.max_actions_per_traj))


def eval_seeds(cfg) -> list[int]:
    """The fixed evaluation seeds of TrainConfig `cfg`: trainer.eval_seeds of them from
    trainer.eval_seed_offset."""
    t = cfg.trainer
    return [t.eval_seed_offset + i for i in range(t.eval_seeds)]


def validate(cfg: TrainConfig, check_env: bool = True) -> TrainConfig:
    """Refuse impossible values with a ConfigError naming the key; returns `cfg`. With
    check_env=False the env name is checked but no instance is built with env.options (for a
    look-up that only needs other keys, e.g. which model `fastpo eval` loads)."""
    r, a, o, t = cfg.rollout, cfg.algorithm, cfg.optim, cfg.trainer

    def need(cond: bool, key: str, value: Any, why: str) -> None:
        if not cond:
            raise ConfigError(f"config key {key!r} = {value!r}: {why}")

    optional = [getattr(cfg, n) for n in OPTIONAL_SECTIONS if getattr(cfg, n) is not None]
    for section in (cfg.model, cfg.env, r, a, o, t, cfg.reward, *optional):
        for key, v in section_items(section):
            vals = v if isinstance(v, list) else [v]
            # beyond float32's range a finite float is inf in the tensors it enters (every update skipped)
            if any(isinstance(x, float) and not (math.isfinite(x) and abs(x) <= FLOAT32_MAX) for x in vals):
                name = {id(cfg.model): "model", id(cfg.env): "env", id(r): "rollout", id(a): "algorithm",
                        id(o): "optim", id(t): "trainer", id(cfg.reward): "reward",
                        **{id(getattr(cfg, n)): n for n in OPTIONAL_SECTIONS}}[id(section)]
                raise ConfigError(f"config key '{name}.{key}' = {v!r}: must be a finite number within float32's "
                                  f"range (+-{FLOAT32_MAX:.4g}), in which fastpo computes")
    # single-field rules live on the fields (`checked`); what follows relates fields
    for section, name in ((cfg.model, "model"), (cfg.env, "env"), (r, "rollout"), (a, "algorithm"), (o, "optim"),
                          (t, "trainer"), (cfg.reward, "reward")):
        check_fields(section, f"{name}.")
    check_sections(cfg)
    check_imitation(cfg)
    rw = cfg.reward
    need(rw.judge_model is None or rw.judge_rubric is not None or rw.judge_rubric_file is not None,
         "reward.judge_model", rw.judge_model, "names a judge, but no rubric is set (reward.judge_rubric or "
         "reward.judge_rubric_file)")
    need(rw.judge_scale != "number" or rw.judge_min < rw.judge_max, "reward.judge_max", rw.judge_max,
         f"must be above reward.judge_min ({rw.judge_min})")
    need(r.max_new_tokens < r.max_context, "rollout.max_new_tokens", r.max_new_tokens,
         f"must be below rollout.max_context ({r.max_context})")
    need(r.engine == "native" or cfg.model.lora_rank == 0, "rollout.engine", r.engine,
         "the SGLang engine takes full weights; LoRA (model.lora_rank > 0) needs rollout.engine=native")
    need(bool(cfg.model.lora_target_modules) and all(isinstance(m, str) and m for m in cfg.model.lora_target_modules),
         "model.lora_target_modules", cfg.model.lora_target_modules,
         "must list the names of the modules LoRA adapts, e.g. [q_proj, v_proj]")
    _check_policy_loss(a, need)
    need(a.overlong_buffer <= r.max_new_tokens, "algorithm.overlong_buffer", a.overlong_buffer,
         f"must be <= rollout.max_new_tokens ({r.max_new_tokens}): the penalty ramps over the last tokens before it")
    if estimator(a.adv_estimator).needs_groups:
        need(r.group_size >= 2, "rollout.group_size", r.group_size,
             f"must be >= 2 for adv_estimator={a.adv_estimator!r} (its baseline is the env group)")
    _check_off_policy(cfg, need)
    need(r.context_window == "full" or (r.reuse == 1 and r.replay == 0), "rollout.context_window",
         r.context_window, "a bounded context window does not support rollout.reuse > 1 or rollout.replay > 0 yet")
    need(r.context_window == "full" or r.engine == "native", "rollout.context_window", r.context_window,
         "a bounded context window needs rollout.engine=native (it evicts KV entries per session)")
    need(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas),
         "optim.betas", o.betas, "must be two numbers in [0, 1)")
    need(o.mini_batch_size <= cfg.train_batch_size, "optim.mini_batch_size", o.mini_batch_size,
         f"is larger than the training batch ({cfg.kept_groups} kept env groups x {r.group_size} "
         f"trajectories = {cfg.train_batch_size})")
    need(t.eval_seed_offset + t.eval_seeds <= 2**32, "trainer.eval_seed_offset", t.eval_seed_offset,
         f"+ trainer.eval_seeds ({t.eval_seeds}) must be <= 2**32 (env seeds are 32-bit)")
    if t.wandb:
        import importlib.util

        need(importlib.util.find_spec("wandb") is not None, "trainer.wandb", t.wandb,
             "wandb is not installed (pip install wandb)")
    members = _check_mixture(cfg, need)
    if check_env:
        # a plain-Python game's reference lines are checked on the evaluation's seeds and horizon
        if members is None:
            _check_env_options(cfg.env.name, cfg.env.options, (eval_seeds(cfg), eval_horizon(r)))
        for m in members or []:
            _check_env_options(m.name, m.options, (eval_seeds(cfg), eval_horizon(member_rollout_config(cfg, m))),
                               member=m)
        for key in ("judge_rubric", "judge_rubric_file"):
            value = getattr(cfg.reward, key)
            if value is not None:
                from fastpo.rubric import check_rubric, read_rubric

                try:
                    (check_rubric if key == "judge_rubric" else read_rubric)(value)
                except ValueError as e:
                    raise ConfigError(f"config key 'reward.{key}' = {value[:60]!r}: {e}") from None
        if cfg.reward.fn is not None:
            from fastpo.rewards import load_reward_fn

            try:
                load_reward_fn(cfg.reward.fn)
            except ValueError as e:
                raise ConfigError(f"config key 'reward.fn' = {cfg.reward.fn!r}: {e}") from None
    return cfg


def _check_policy_loss(a: AlgorithmConfig, need) -> None:
    """algorithm.policy_loss is a registered loss; every registered loss's own settings keep
    their rules (`fastpo.kernels.losses.settings_problem`); the clip bounds form PPO's range and
    GSPO's sequence ratio is used as the loss's facts (`PolicyLoss`) allow."""
    losses = _policy_losses()
    need(a.policy_loss in losses.POLICY_LOSSES, "algorithm.policy_loss", a.policy_loss,
         f"must be one of {', '.join(losses.POLICY_LOSSES)} (the registered policy losses; "
         "fastpo.kernels.register_policy_loss adds one)")
    problem = losses.settings_problem(a.loss_settings)
    if problem is not None:
        name, value, why = problem
        need(False, f"algorithm.{name}", value, why)
    loss = losses.POLICY_LOSSES[a.policy_loss]
    unbounded = ", ".join(n for n, x in losses.POLICY_LOSSES.items() if not x.clip_range)
    need(a.clip_high >= a.clip_low or not loss.clip_range, "algorithm.clip_high", a.clip_high,
         f"must be >= algorithm.clip_low ({a.clip_low})")
    need(a.clip_low < 1 or not loss.clip_range, "algorithm.clip_low", a.clip_low,
         f"must be < 1 (the ratio's lower clip bound is 1 - clip_low; only the IS weight of policy_loss "
         f"{unbounded} may go without a lower bound, clip_low >= 1)")
    need(a.ratio_level == "token" or loss.sequence_ratio, "algorithm.ratio_level", a.ratio_level,
         f"GSPO's sequence ratio is defined for policy_loss "
         f"{' and '.join(n for n, x in losses.POLICY_LOSSES.items() if x.sequence_ratio)}, not {a.policy_loss!r}")


def _check_off_policy(cfg: TrainConfig, need) -> None:
    """Rollout reuse, replay and the importance-sampling correction (issue 13's keys)."""
    a = cfg.algorithm
    need(not (a.ratio_level == "sequence" and a.is_correction != "none" and a.is_level == "token"),
         "algorithm.is_level", a.is_level,
         f"contradicts algorithm.ratio_level='sequence' (GSPO) with is_correction={a.is_correction!r}: a "
         "trajectory's one ratio cannot take per-token weights; use algorithm.is_level=sequence")


def _check_mixture(cfg: TrainConfig, need) -> Optional[list]:
    """The members of env.mixture (None without one), each resolved and its rollout settings
    checked; ConfigError naming env.mixture or env.name for what is wrong."""
    from fastpo.envs import MIXTURE, EnvError, parse_mixture, resolve_env

    e = cfg.env
    if not e.mixture:
        need(e.name != MIXTURE, "env.name", e.name, "names a mixture: list its games in env.mixture "
             "(e.g. env.mixture=[sokoban, frozenlake]) or give --env a,b")
        return None
    need(e.name == MIXTURE, "env.name", e.name, f"is set beside env.mixture: give one game in env.name or several in "
         f"env.mixture (whose run's env.name is {MIXTURE!r})")
    need(not e.options, "env.options", e.options, "applies to one game: in a mixture give each entry its own "
         "'options'")
    try:
        members = parse_mixture(e.mixture)
        for m in members:
            resolve_env(m.name)
    except EnvError as err:
        raise ConfigError(f"config key 'env.mixture': {err}") from None
    for i, m in enumerate(members):
        try:
            member_rollout_config(cfg, m)
        except ValueError as err:
            raise ConfigError(f"config key 'env.mixture' entry {i} ({m.label}): {err}") from None
    return members


def settled_mixture(entries: list, rollout, explicit: set) -> list:
    """env.mixture's entries with each game's own settings written into its `settings` (the
    run's config.yaml then says what each game plays with): the game's built-in settings (e.g.
    Bandit's single turn), except a key the user set in the `rollout` section (`explicit`: from
    a config file or the command line), which keeps the user's value as for one game; the
    entry's own settings over both. Entries that are not valid are left for `validate`."""
    from fastpo.envs import EnvError, resolve_env

    out = []
    for e in entries:
        e = {"name": e} if isinstance(e, str) else e
        if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("settings", {}) or {}, dict):
            try:
                game = resolve_env(e["name"].strip()).settings
            except EnvError:
                game = {}
            own = {k: getattr(rollout, k) if k in explicit else v for k, v in game.items()}
            if own:
                e = {**e, "settings": {**own, **(e.get("settings") or {})}}
        out.append(e)
    return out


def env_members(cfg: TrainConfig) -> list:
    """The games of TrainConfig `cfg` as `fastpo.envs.EnvMember`s: env.mixture's entries, or one
    member (label = env.name, weight 1) for a single game. Raises ConfigError for a bad mixture."""
    from fastpo.envs import EnvError, EnvMember, parse_mixture

    if not cfg.env.mixture:
        return [EnvMember(cfg.env.name, cfg.env.name, 1.0, dict(cfg.env.options), {})]
    try:
        return parse_mixture(cfg.env.mixture)
    except EnvError as err:
        raise ConfigError(f"config key 'env.mixture': {err}") from None


def member_rollout_config(cfg: TrainConfig, member) -> RolloutConfig:
    """The RolloutConfig a member plays with: the run's `rollout` section, then (in a mixture)
    the game's own settings (e.g. Bandit's single turn), then the entry's `settings`. A single
    game's settings were applied with the presets, so its member takes the section as it is."""
    if not cfg.env.mixture:
        return cfg.rollout.rollout_config()
    from fastpo.envs import resolve_env

    return cfg.rollout.rollout_config(**{**resolve_env(member.name).settings, **member.settings})


def _check_env_options(name: str, options: dict, bounds: Optional[tuple] = None, member=None) -> None:
    """Dry run: build one instance of env `name` with `options` (no model; cheap;
    `fastpo.envs.check_env`). Sokoban with non-default options also resets it once (under a
    second), which finds impossible levels such as more boxes than a room holds; a
    plain-Python game is played once and its reference lines checked on `bounds` = (eval
    seeds, horizon).

    Raises ConfigError naming `env.options` for an unknown key or a bad value, and the env for
    a name that does not resolve.
    """
    from fastpo.envs import EnvError, check_env, resolve_env

    key, opts = ("env.name", f"'env.options' = {options!r}") if member is None else \
        (f"env.mixture ({member.label})", f"'env.mixture' ({member.label}) options {options!r}")
    try:
        resolve_env(name)
    except EnvError as e:
        raise ConfigError(f"config key '{key}': {e}") from None
    try:
        check_env(name, options, bounds)
    except EnvError as e:
        raise ConfigError(f"config key '{key}' = {name!r}: {e}" if not options else
                          f"config key {opts} for env {name!r}: {e}") from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"config key {opts} for env {name!r}: {e}") from None


def env_preset(name: str) -> dict:
    """The settings env `name` fixes (its spec's: `fastpo.envs.registry.BUILTIN_SETTINGS` for a
    built-in game, a plain-Python game's `settings`); ConfigError naming `env.name` when the name does not resolve."""
    from fastpo.envs import EnvError, env_preset as preset

    try:
        return preset(name)
    except EnvError as e:
        raise ConfigError(f"config key 'env.name': {e}") from None


def load_config(env: Optional[str] = None, preset: Optional[str] = None, file: Optional[str] = None,
                overrides: Optional[list[str]] = None, values: Optional[dict] = None,
                check_env: bool = True, sections: tuple = ()) -> TrainConfig:
    """Build and validate a TrainConfig: defaults -> named presets -> env preset -> YAML -> overrides.

    `preset` may be several comma-separated names applied in order (e.g. "cpu,grpo"); None
    means `default_preset()`. A YAML file may itself name `env` and `preset`; the command
    line's win. `values` maps dotted keys to values taken literally, not parsed as YAML (what
    --model and --out give: a path may hold '#', ':' or digits only); applied before `overrides`.
    `sections`: the optional sections the command reads ("sft", "dagger";
    fastpo.config.imitation), present with their defaults before the presets; a layer that
    sets another one is refused.
    Raises ConfigError (ValueError) naming the bad key or value; FileNotFoundError
    for a missing file.
    """
    file_dict = read_config_file(file) if file else {}
    override_dicts = [parse_override(o) for o in (overrides or [])]
    refuse_sections(file_dict, sections, f"config file {file}")
    for o, d in zip(overrides or [], override_dicts):
        refuse_sections(d, sections, f"override {o!r}")
    for key in values or {}:
        refuse_sections(nested_dict(key, None), sections, f"value of {key}")
    for d in override_dicts:
        if "preset" in d:  # applying it would only relabel the run, not apply the preset's settings
            raise ConfigError(f"override 'preset={d['preset']}': presets are chosen with --preset NAME[,NAME...] "
                              "(or `preset:` in a config file), not as a dotted override")
    for d in (file_dict, *override_dicts):  # empty would silently mean the default folder
        out = d.get("trainer") if isinstance(d.get("trainer"), dict) else {}
        if "output_dir" in out and (out["output_dir"] is None or not str(out["output_dir"]).strip()):
            raise ConfigError(f"config key 'trainer.output_dir' = {out['output_dir']!r}: must name a folder "
                              "(leave it out for runs/<env>)")
    from fastpo.envs import MIXTURE

    named = env or dig(override_dicts, ("env", "name")) or (file_dict.get("env") or {}).get("name")
    if named is not None and not isinstance(named, str):
        raise ConfigError(f"config key 'env.name' = {named!r}: must be an environment name")
    listed = [n.strip() for n in named.split(",")] if named and "," in named else None  # --env a,b: a mixture
    if listed is not None:
        named = MIXTURE
    if env and isinstance(file_dict.get("env"), dict):  # --env wins over the file's game(s), as over its name
        file_dict["env"].pop("mixture", None)
    mixed = listed or dig(override_dicts, ("env", "mixture")) or (values or {}).get("env.mixture") \
        or (file_dict.get("env") or {}).get("mixture")
    if mixed and named is not None and named != MIXTURE:
        raise ConfigError(f"config key 'env.name' = {named!r}: is set beside env.mixture; give one game in env.name or "
                          f"several in env.mixture (whose run's env.name is {MIXTURE!r})")
    env_name = MIXTURE if mixed else (named or "frozenlake")
    # a mixture's games fix their own settings per member (member_rollout_config)
    fixed_by_env = {} if env_name == MIXTURE else env_preset(env_name)
    preset_names = preset or file_dict.pop("preset", None) or default_preset()
    file_dict.pop("preset", None)
    cfg = TrainConfig()
    cfg.env.name = env_name
    add_sections(cfg, sections)
    names = [p.strip() for p in str(preset_names).split(",") if p.strip()]
    if not names:
        raise ConfigError(f"preset {preset_names!r} names no preset; choose from {', '.join(PRESETS)}")
    for name in names:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        refuse_sections(PRESETS[name], sections, f"preset {name!r}")
        apply_dict(cfg, PRESETS[name])
    apply_dict(cfg, fixed_by_env)
    cfg.preset = ",".join(names)
    apply_dict(cfg, file_dict)
    for key, value in (values or {}).items():
        apply_dict(cfg, nested_dict(key, value))
    for d in override_dicts:
        apply_dict(cfg, d)
    if listed is not None:
        cfg.env.mixture = listed
    cfg.env.name = env_name
    if cfg.env.mixture:
        explicit = {k for d in (file_dict, *override_dicts) if isinstance(d.get("rollout"), dict) for k in d["rollout"]}
        explicit |= {k.split(".", 1)[1] for k in (values or {}) if k.startswith("rollout.")}
        cfg.env.mixture = settled_mixture(cfg.env.mixture, cfg.rollout, explicit)
    if not cfg.trainer.output_dir:
        cfg.trainer.output_dir = default_run_folder(cfg.env.name)
    if cfg.reward.judge_rubric is not None and cfg.reward.judge_rubric_file is not None:
        raise ConfigError(f"config key 'reward.judge_rubric_file' = {cfg.reward.judge_rubric_file!r}: give the rubric "
                          "once: as reward.judge_rubric (text) or reward.judge_rubric_file, not both")
    return validate(inline_rubric_file(cfg), check_env)


def inline_rubric_file(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with reward.judge_rubric_file's text as reward.judge_rubric (the file key cleared),
    so that a run's config.yaml holds the rubric it was judged with: a resume or `fastpo eval`
    never reads the file again (it may have moved or changed). On a resume, a file given as an
    override replaces the saved text. Raises ConfigError (one line) for an unreadable file or a
    rubric without a place for the answer."""
    path = cfg.reward.judge_rubric_file
    if path is not None:
        from fastpo.rubric import read_rubric

        try:
            cfg.reward.judge_rubric = read_rubric(path)
        except ValueError as e:
            raise ConfigError(f"config key 'reward.judge_rubric_file' = {path!r}: {e}") from None
        cfg.reward.judge_rubric_file = None
    return cfg


def default_run_folder(env_name: str, prefix: str = "") -> str:
    """runs/<prefix><env name>, the name made a folder name (no ':' or '/': `mymod:Game` -> `mymod_Game`)."""
    return "runs/" + prefix + re.sub(r"[^A-Za-z0-9._-]+", "_", env_name)


# ------------------------------------------------------------- a run's saved configuration

def read_run_config(path: str) -> TrainConfig:
    """The validated TrainConfig in a run's (or a checkpoint's) config.yaml at `path`.

    Raises FileNotFoundError when it is missing; ConfigError when it cannot be read, is not
    valid YAML or not a valid fastpo configuration (each naming `path`).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {os.path.dirname(path) or '.'} a fastpo run folder?")
    try:
        with open(path, encoding="utf-8") as f:
            d = parse_config_yaml(f, path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the run's configuration ({e.strerror or e})") from None
    try:
        return config_from_dict(d)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: not a valid fastpo configuration ({e})") from None


def load_run_config(out_dir: str) -> TrainConfig:
    """The configuration a run was started with (`OUT/config.yaml`, `read_run_config`; the
    `sft` / `dagger` sections of a run folder made before config.yaml held them come from its
    sft.yaml / dagger.yaml, `fastpo.config.imitation.legacy_sections`)."""
    cfg = read_run_config(os.path.join(out_dir, "config.yaml"))
    return validate(cfg, check_env=False) if apply_legacy_sections(cfg, out_dir) else cfg


def config_from_dict(d: dict) -> TrainConfig:
    """Rebuild a validated TrainConfig from `TrainConfig.to_dict()` output (used on resume),
    with the optional sections (`sft`, `dagger`) that `d` holds."""
    cfg = TrainConfig()
    add_sections(cfg, [name for name in OPTIONAL_SECTIONS if d.get(name) is not None])
    apply_dict(cfg, d)
    return validate(cfg)
