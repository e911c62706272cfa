"""Training configuration: dataclasses with the paper's defaults, presets, YAML and dotted overrides.

The schema is a tree of dataclasses (`TrainConfig` at the root). Defaults are the RAGEN
paper's (arXiv 2504.20073, Sec. 5 and App. B; DESIGN.md "The paper in numbers"): 8 env
groups x 16 trajectories, 5 turns, 10 actions, PPO mini-batch 32, GAE gamma = lambda = 1,
entropy coefficient 0.001, actor lr 1e-6, critic lr 1e-5, grad clip 1.0, 200 iterations,
eval on 256 fixed seeds at temperature 0.5 every 10 iterations, StarPO-S (top-25% reward-std
filtering, no KL, clip-higher 0.2 / 0.28).

A configuration is built in layers, each validated before any model loads:

    defaults -> named preset (paper | cpu | starpo | grpo ...) -> environment preset
             -> YAML file -> dotted command-line overrides (``algorithm.adv_estimator=grpo``)

`load_config` does all of it; errors are `ConfigError` (a `ValueError`) naming the key.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Optional, Union

import yaml

from fastpo.registry import ESTIMATOR_NAMES, LOSS_AGGREGATION_NAMES, estimator


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type or an impossible value."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """A constraint on one config field: `ok(value)` must hold for a value of the field's
    annotated type; `why` says the rule in the error ("must be > 0")."""

    ok: Callable[[Any], bool]
    why: str


def checked(default: Any, ok: Callable[[Any], bool] = lambda v: True, why: str = "") -> Any:
    """A dataclass field with `default` whose values must have the annotated type and satisfy
    `ok` (see `check_fields`)."""
    return field(default=default, metadata={"rule": Rule(ok, why)})


def check_fields(obj: Any, prefix: str = "", what: str = "config key") -> None:
    """Check every field of dataclass `obj` that carries a `Rule` (made with `checked`): its
    type (the annotation, as `apply_dict` reads it), then the rule. The one validator of
    field constraints, for `validate` and for the dataclasses' own `__post_init__`.

    Raises ConfigError (a ValueError) "config key 'rollout.top_p' = 2: must be in (0, 1]",
    naming `prefix` + the field and the value.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        if rule is None:
            continue
        value, key = getattr(obj, f.name), repr(f"{prefix}{f.name}")
        key = f"{what} {key}" if what else key
        ok, _ = _type_ok(value, hints[f.name])
        if not ok:
            raise ConfigError(f"{key}: expected {_describe(hints[f.name])}, got {value!r} ({type(value).__name__})")
        if not rule.ok(value):
            raise ConfigError(f"{key} = {value!r}: {rule.why}")


#: Upper bound on rollout.max_actions_per_turn (the paper uses 5; more only pads the prompt).
MAX_ACTIONS_PER_TURN = 64

# Sampling rules shared by the rollout config and the engine's SamplingParams.
TOP_P_RULE = Rule(lambda v: 0 < v <= 1, "must be in (0, 1]")
TOP_K_RULE = Rule(lambda v: v >= 0, "must be >= 0 (0 = off)")


def _at_least(n: int) -> Callable[[Any], bool]:
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
    """Which policy model to train and how.

    `name`: "smollm2-135m-instruct" (embedded), an HF id or local path, or "random:<shape>".
    `dtype`: "auto" (fp32 on the CPU, bf16 on CUDA), "float32" or "bfloat16".
    `lora_rank` > 0 trains LoRA adapters through peft instead of the full weights.
    """

    name: str = checked("smollm2-135m-instruct", bool, "must not be empty")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    gradient_checkpointing: bool = False
    lora_rank: int = checked(0, _at_least(0), "must be >= 0 (0 = full fine-tuning)")
    lora_alpha: int = checked(16, lambda v: v > 0, "must be > 0")
    lora_dropout: float = checked(0.0, lambda v: 0 <= v < 1, "must be in [0, 1)")
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class EnvConfig:
    """The environment: `name` in {bandit, sokoban, frozenlake}; `options` go to `make_env`."""

    name: Literal["bandit", "sokoban", "frozenlake"] = "frozenlake"
    options: dict = field(default_factory=dict)


@dataclass
class RolloutConfig:
    """Multi-turn rollout settings (defaults: the paper / RAGEN's).

    max_turns: turns per trajectory (5). max_actions_per_turn: actions read from one answer
    (5; extra ones are ignored, not penalised). max_actions_per_traj: action budget of a
    trajectory (10); it ends when spent. max_new_tokens: response tokens per turn (400).
    max_context: tokens per trajectory (3600); a trajectory that would pass it ends
    truncated. temperature / top_p / top_k: sampling (temperature scales the logits; the
    recorded log-probs are at this temperature). think: prime with "<think>" (True) or the
    answer-only variant primed with "<answer>". format_penalty: added to a turn's reward
    when its answer is missing or holds an invalid action (-0.1). format_rule: what counts
    as an answer (rollout/parsing.py): "ragen" (default) is RAGEN's rule, the first
    think/answer pattern found anywhere in the response (none found: no action runs);
    "strict" also penalises any response that is not exactly the pattern.
    run_valid_actions_on_format_error: in a penalised turn, still execute the valid actions
    of the answer found (True; what RAGEN does with an answer holding an invalid action);
    False executes nothing. stop_at_answer_close: end a response at "</answer>" (the
    template's end-of-turn token is then appended, loss mask 0; RAGEN generates on to the
    end-of-turn token). system_prompt: None for prompts.SYSTEM_PROMPT
    (SYSTEM_PROMPT_NO_THINK when think is False). feedback_invalid: tell the model which
    actions were invalid in the next user message. prompt_examples: in answer-only mode, end
    every user message with a question and three answers in the exact format built from the
    game's action names (prompts.move_question) instead of RAGEN's "<answer> [your answer]
    </answer>" reminder (False; no effect with think=True, whose format it does not show);
    the CPU preset turns it on (README, "The main job on 2 CPU cores").
    context_window: "full" (default: every turn stays in the context) or K >= 1, the last K
    turns (user observation + response) kept in the context, the system prompt and the
    first user message (task rules, initial state) always kept; RAGEN's
    `limited_multi_turn` with `max_context_window: K`. fastpo evicts the dropped turns'
    KV entries and keeps positions (see fastpo/window.py for the design).
    """

    max_turns: int = checked(5, _at_least(1), "must be >= 1")
    max_actions_per_turn: int = checked(5, lambda v: 1 <= v <= MAX_ACTIONS_PER_TURN,
                                        f"must be >= 1 and <= {MAX_ACTIONS_PER_TURN}")
    max_actions_per_traj: int = checked(10, _at_least(1), "must be >= 1")
    max_new_tokens: int = checked(400, _at_least(1), "must be >= 1")
    max_context: int = checked(3600, _at_least(1), "must be >= 1")
    # > 0: the recorded log-probs and the trainer's loss divide the logits by it (greedy
    # decoding is the engine's SamplingParams(temperature=0), not a rollout setting)
    temperature: float = checked(1.0, lambda v: v > 0, "must be > 0 (the logits are divided by it)")
    top_p: float = checked(1.0, TOP_P_RULE.ok, TOP_P_RULE.why)
    top_k: int = checked(0, TOP_K_RULE.ok, TOP_K_RULE.why)
    think: bool = True
    format_penalty: float = checked(-0.1, lambda v: v <= 0, "must be <= 0")
    format_rule: Literal["ragen", "strict"] = checked("ragen")
    run_valid_actions_on_format_error: bool = True
    stop_at_answer_close: bool = True
    system_prompt: str | None = None
    feedback_invalid: bool = True
    prompt_examples: bool = False
    context_window: int | str = checked("full", _window_ok, CONTEXT_WINDOW_WHY)

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
    their defaults and meaning) plus the batch shape, env_groups x group_size trajectories
    (paper: P=8 env groups x N=16), and the generation backend: `engine`
    "native" (fastpo's sampler on the trained module itself) or "sglang" (an `sglang.Engine`
    holding a bf16 copy of the weights, refreshed after each update; CUDA only,
    `pip install "fastpo[sglang]"`), with `sglang_mem_fraction` of the GPU memory for its
    weights and KV cache (released while training). `sampling_streams`: "batch" draws the
    whole rollout batch from one random stream (today's one-process sampling); "group" gives
    each env group its own stream seeded from (iteration, group), so a group samples the same
    tokens however the batch is split over processes (native engine); "auto" (default):
    batch with one process, group with several (fastpo.distributed).

    Off-policy data (RAGEN's rollout frequency and replay, arXiv 2504.20073): `reuse` K >= 1
    trains K consecutive iterations on one rollout batch ("Online-K"; 1 = a fresh batch
    every iteration), its old log-probs staying those of the policy that sampled it.
    `replay` N >= 0 keeps the trajectories of the last N rollout batches (their sampler
    log-probs with them; fastpo.replay) and mixes round(`replay_fraction` x fresh batch
    size) of them, `replay_fraction` in [0, 1], into each update (0 = no buffer)."""

    env_groups: int = checked(8, _at_least(1), "must be >= 1")
    group_size: int = checked(16, _at_least(1), "must be >= 1")
    engine: Literal["native", "sglang"] = "native"
    sampling_streams: Literal["auto", "batch", "group"] = "auto"
    sglang_mem_fraction: float = checked(0.4, lambda v: 0 < v < 1, "must be in (0, 1)")
    reuse: int = checked(1, _at_least(1), "must be >= 1 (1 = a fresh rollout batch every iteration)")
    replay: int = checked(0, _at_least(0), "must be >= 0 rollout batches (0 = no replay buffer)")
    replay_fraction: float = checked(0.5, lambda v: 0 <= v <= 1, "must be in [0, 1] (replayed trajectories per "
                                     "update, as a fraction of the fresh batch)")

    KEY_PREFIX: ClassVar[str] = "rollout."

    def rollout_config(self, **changes: Any) -> RolloutConfig:
        """The plain RolloutConfig of this section (batch shape dropped), with `changes` applied."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(RolloutConfig)}
        kw.update(changes)
        return RolloutConfig(**kw)


@dataclass
class AlgorithmConfig:
    """StarPO / StarPO-S algorithm settings.

    `adv_estimator`: "gae" (PPO with a critic), "grpo" ((R - mean)/(std + 1e-6) per env group),
    "drgrpo" (R - mean, no std division; Dr.GRPO), "rloo" (R minus the mean of the group's
    other trajectories; RLOO), "reinforce_pp" (each model token's discounted return,
    normalised over the batch; REINFORCE++) or "reinforce_pp_baseline" (R - group mean,
    normalised over the batch's tokens); fastpo.algorithms.advantages.
    `reward_position`: where a trajectory's reward sits for GAE: "last_token" (the last model
    token of the trajectory, the paper's default) or "turn" (each turn's reward on that
    turn's last model token).
    `filter_mode`: StarPO-S rollout filtering: "top" keeps the `filter_ratio` of env groups
    with the highest in-group reward std, "bottom" the lowest, "none" keeps all.
    `filter_strategy` (RAGEN head's rollout filters, fastpo/algorithms/filtering.py):
    "top_k" (default, the paper's: int(filter_ratio x groups), at least 1), "top_p" (the
    groups whose stds make up `filter_ratio` of the total, `filter_top_p_mode` "linear"
    with slack `filter_eps`, or "softmax" mass), "min_p" (std >= filter_ratio x the best).
    `filter_keep_zero_std` false drops groups without reward spread first.
    `soft_advantage_reweight`: scale each trajectory's advantages by its group's reward std
    / the batch's largest group std (RAGEN head), with or without filtering.
    `kl_coef` > 0 penalises KL to a frozen reference model (plain StarPO), estimator k1 or k3,
    either per token on the reward before the advantages (`kl_in_reward` true: verl's
    `apply_kl_penalty`, r_t - kl_coef * kl_t on every model token, what RAGEN's PPO runs did)
    or as a loss term (false: + kl_coef * kl_t in the policy loss, what its GRPO runs did).
    `kl_in_reward` null (default) picks the reward for gae and reinforce_pp (token-level
    returns: REINFORCE++ puts the KL on the reward) and the loss for the group estimators
    (grpo, drgrpo, rloo, reinforce_pp_baseline).
    `loss_agg`: how token losses become the mini-batch loss. "seq-mean-token-mean" (default,
    every preset) is the paper's objective (1/G) sum_i (1/|tau_i|) sum_t: each trajectory's
    token mean, then the mean over trajectories, so a long trajectory weighs as much as a
    short one. "token-mean" (verl's default; fastpo's before) divides by all tokens of the
    mini-batch; "seq-mean-token-sum" sums each trajectory's tokens.
    `old_logprob`: PPO's old log-probs "recompute"d by the trainer after the rollout, taken
    from the "sampler", or "auto": the sampler's exactly when they are the same quantity
    (native engine on the trained fp32 module; fastpo.old_logprob).
    `ratio_level`: PPO's per-token ratio ("token") or GSPO's sequence ratio ("sequence",
    arXiv 2507.18071: exp of the mean token log-ratio of a trajectory, clipped per
    trajectory; its objective is seq-mean-token-mean's).
    `is_correction`: importance-sampling correction of the sampler -> trainer gap
    (fastpo.algorithms.correction): "none", "tis" (weight min(rho, is_cap), rho =
    pi_old / pi_sampler) or "mis" (weight rho, units whose rho leaves [1/is_cap, is_cap]
    dropped from the loss), per token or per trajectory (`is_level`); `is_cap` > 1.
    `value_loss_agg`: the critic's clipped value loss aggregated like `loss_agg` (the same
    function, fastpo.kernels.aggregate; verl's critic has its own setting too), "token-mean"
    by default: over all model tokens of the mini-batch.
    """

    adv_estimator: Literal[ESTIMATOR_NAMES] = "gae"  # fastpo.registry.ESTIMATORS
    gamma: float = checked(1.0, _in_unit, "must be in [0, 1]")
    lam: float = checked(1.0, _in_unit, "must be in [0, 1]")
    reward_position: Literal["last_token", "turn"] = "last_token"
    whiten_advantages: bool = True
    filter_mode: Literal["top", "bottom", "none"] = "top"
    filter_ratio: float = checked(0.25, lambda v: 0 < v <= 1, "must be in (0, 1]")
    filter_strategy: Literal["top_k", "top_p", "min_p"] = "top_k"
    filter_top_p_mode: Literal["linear", "softmax"] = "linear"
    filter_eps: float = checked(0.01, _at_least(0), "must be >= 0")
    filter_keep_zero_std: bool = True
    soft_advantage_reweight: bool = False
    clip_low: float = checked(0.2, lambda v: v > 0, "must be > 0")
    clip_high: float = 0.28
    dual_clip: Optional[float] = checked(3.0, lambda v: v is None or v > 1, "must be > 1 or null")
    entropy_coef: float = checked(0.001, _at_least(0), "must be >= 0")
    kl_coef: float = checked(0.0, _at_least(0), "must be >= 0")
    kl_estimator: Literal["k1", "k3"] = "k1"
    kl_in_reward: Optional[bool] = None
    loss_agg: Literal[LOSS_AGGREGATION_NAMES] = "seq-mean-token-mean"  # fastpo.registry.LOSS_AGGREGATIONS
    old_logprob: Literal["recompute", "sampler", "auto"] = "auto"
    ratio_level: Literal["token", "sequence"] = "token"
    is_correction: Literal["none", "tis", "mis"] = "none"
    is_level: Literal["token", "sequence"] = "token"
    is_cap: float = checked(2.0, lambda v: v > 1, "must be > 1 (importance weights are truncated at is_cap, and "
                                               "mis keeps [1/is_cap, is_cap])")
    # critic (PPO only)
    critic: Literal["separate", "shared"] = "separate"
    value_clip: float = checked(0.5, lambda v: v > 0, "must be > 0")
    value_coef: float = checked(0.5, _at_least(0), "must be >= 0")
    value_loss_agg: Literal[LOSS_AGGREGATION_NAMES] = "token-mean"


@dataclass
class OptimConfig:
    """Optimizer and update schedule. `mini_batch_size` counts trajectories; `micro_token_budget` tokens.

    `share_prefix`: pack an env group's members after one copy of their common prompt
    (fastpo.packing.shared_prefixes); the same log-probs and gradients, less compute.
    """

    actor_lr: float = checked(1e-6, lambda v: v > 0, "must be > 0")
    critic_lr: float = checked(1e-5, lambda v: v > 0, "must be > 0")
    weight_decay: float = checked(0.01, _at_least(0), "must be >= 0")
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = checked(1.0, lambda v: v > 0, "must be > 0")
    ppo_epochs: int = checked(1, _at_least(1), "must be >= 1")
    mini_batch_size: int = checked(32, _at_least(1), "must be >= 1")
    micro_token_budget: int = checked(8192, _at_least(16), "must be >= 16 tokens")
    # compute an env group's shared prompt once per micro-batch (needs fastpo's segment attention)
    share_prefix: bool = True


@dataclass
class TrainerSection:
    """Loop length, evaluation, logging, checkpoints, Echo-Trap warning."""

    iterations: int = checked(200, _at_least(1), "must be >= 1")
    seed: int = checked(0, _seed_range, "must be in [0, 2**32)")
    device: str = checked("auto", lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None,
                          "must be auto, cpu or cuda[:N]")
    output_dir: str = ""
    eval_every: int = checked(10, _at_least(0), "must be >= 0 (0 = never)")
    eval_seeds: int = checked(256, _at_least(1), "must be >= 1")
    eval_seed_offset: int = checked(1_000_000, _seed_range, "must be in [0, 2**32)")
    eval_temperature: float = checked(0.5, lambda v: v > 0, "must be > 0")
    eval_group_size: int = checked(1, _at_least(1), "must be >= 1")
    eval_before_training: bool = False
    save_every: int = checked(10, _at_least(0), "must be >= 0 (0 = only at the end)")
    keep_checkpoints: int = checked(2, _at_least(1), "must be >= 1")
    num_samples: int = checked(4, _at_least(0), "must be >= 0")
    ema_decay: float = checked(0.9, lambda v: 0 < v < 1, "must be in (0, 1)")
    tensorboard: bool = False
    wandb: bool = False
    plots: bool = True
    echo_trap_drop: float = checked(0.5, lambda v: 0 < v < 1, "must be in (0, 1)")
    echo_trap_window: int = checked(5, _at_least(1), "must be >= 1")
    # mutual-information collapse metrics (fastpo/collapse.py): iteration 1 and every N-th; 0 = off
    collapse_every: int = checked(5, _at_least(0), "must be >= 0 (0 = never)")
    kernel_impl: str = checked("auto", lambda v: v in ("auto", "reference", "chunked", "triton"),
                               "must be auto, reference, chunked or triton")
    progress: bool = True
    # several processes (torchrun): fsdp = FSDP2 shards the trained modules' parameters,
    # gradients and optimizer state over the ranks; replicate = every rank holds them whole
    # (summed gradients, DDP-style). One process without torchrun: no effect.
    data_parallel: str = checked("fsdp", lambda v: v in ("replicate", "fsdp"), "must be fsdp or replicate")


@dataclass
class TrainConfig:
    """The root of the configuration tree."""

    preset: str = "paper"
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
    def train_batch_size(self) -> int:
        """Trajectories per iteration after filtering."""
        return self.kept_groups * self.rollout.group_size




# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

#: Per-environment settings (what the game itself fixes), applied after the named preset.
ENV_PRESETS: dict[str, dict] = {
    "bandit": {"rollout": {"max_turns": 1, "max_actions_per_turn": 1, "max_actions_per_traj": 1}},
    # multi-turn games: the defaults (5 turns, 5 actions per turn, 10 per trajectory) or the preset's
    "sokoban": {},
    "frozenlake": {},
}

#: Named presets. "paper" is the defaults; "cpu" is sized to finish `fastpo train --env
#: frozenlake` on 2 cores in under 10 minutes.
PRESETS: dict[str, dict] = {
    "paper": {},
    # measured choices: README "The CPU preset" (answer-only with answer examples, Dr.GRPO, 64 eval
    # seeds before and after)
    "cpu": {
        "rollout": {"env_groups": 4, "group_size": 4, "max_turns": 5, "max_new_tokens": 16, "max_context": 1536,
                    "think": False, "prompt_examples": True, "temperature": 0.7},
        "algorithm": {"adv_estimator": "drgrpo", "filter_mode": "none", "critic": "shared"},
        "optim": {"actor_lr": 1e-5, "critic_lr": 1e-4, "mini_batch_size": 16, "micro_token_budget": 2048},
        "trainer": {"iterations": 8, "eval_every": 8, "eval_seeds": 64, "eval_before_training": True, "save_every": 8,
                    "num_samples": 2, "echo_trap_window": 1},
    },
    # StarPO (no -S): KL 0.001 (k1) to a frozen reference, on the reward with PPO and in the loss
    # with GRPO (kl_in_reward null), symmetric clipping, no filtering: RAGEN's train_all.sh
    "starpo": {"algorithm": {"filter_mode": "none", "kl_coef": 0.001, "kl_estimator": "k1",
                             "clip_low": 0.2, "clip_high": 0.2}},
    "grpo": {"algorithm": {"adv_estimator": "grpo"}},
    # tiny: what the end-to-end tests use (1 group x 2 trajectories, 1-2 turns, 16 new tokens).
    "tiny": {
        "rollout": {"env_groups": 1, "group_size": 2, "max_turns": 2, "max_new_tokens": 16, "max_context": 1024},
        "algorithm": {"filter_mode": "none", "critic": "shared"},
        "optim": {"actor_lr": 1e-5, "critic_lr": 1e-4, "mini_batch_size": 2, "micro_token_budget": 1024},
        "trainer": {"iterations": 2, "eval_every": 2, "eval_seeds": 2, "save_every": 1, "num_samples": 1,
                    "echo_trap_window": 1, "plots": True, "progress": False},
    },
}

#: What the CPU preset changes, said at start.
def cpu_preset_note(cfg: "TrainConfig") -> str:
    """What the CPU preset scaled down, said at start, with this run's values (overrides included)."""
    r, a, o, t = cfg.rollout, cfg.algorithm, cfg.optim, cfg.trainer
    filt = "no filtering" if a.filter_mode == "none" else f"StarPO-S {a.filter_mode}-{a.filter_ratio:.0%} filtering"
    critic = {"shared": "critic sharing the policy trunk", "separate": "a separate critic"}[a.critic] \
        if estimator(a.adv_estimator).needs_critic else f"{a.adv_estimator} (no critic)"
    prompt = "think prompt" if r.think else ("answer-only prompt with answer examples" if r.prompt_examples
                                              else "answer-only prompt")
    evals = f"eval on {t.eval_seeds} seeds" + (" before and after training" if t.eval_before_training else "")
    return (
        "CPU preset (no GPU found): scaled down from the paper's 8 env groups x 16 trajectories, 5 turns, "
        "400 new tokens/turn, 200 iterations, StarPO-S top-25% filtering and a separate critic, eval on 256 seeds "
        f"-> this run: {r.env_groups} groups x {r.group_size} trajectories, {r.max_turns} turn{'s' if r.max_turns != 1 else ''}, "
        f"{r.max_new_tokens} new tokens/turn, {prompt}, temperature {r.temperature:g}, {t.iterations} iterations, "
        f"{filt}, {critic}, actor lr {o.actor_lr:g}, {evals}. For the paper's scale use `--preset paper` on a GPU "
        "(and `--model Qwen/Qwen2.5-0.5B-Instruct` where that model is available)."
    )


def default_preset() -> str:
    """"paper" when CUDA is available, else "cpu"."""
    try:
        import torch

        return "paper" if torch.cuda.is_available() else "cpu"
    except Exception:  # torch missing or broken: the CPU preset is the safe choice
        return "cpu"


# ---------------------------------------------------------------------------------------------
# Merging and type checking
# ---------------------------------------------------------------------------------------------

def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and lightly coerce: int -> float) `value` against annotation `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return True, None
                continue
            ok, v = _type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if tp is list or origin is list:
        return isinstance(value, (list, tuple)), list(value) if isinstance(value, (list, tuple)) else value
    if tp is dict or origin is dict:
        return isinstance(value, dict), value
    return isinstance(value, tp), value


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Union:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _did_you_mean(obj: Any, key: str, prefix: str) -> str:
    """' (did you mean ...?)' for a key that exists one level down (a bare `group_size`) or is
    a near miss of a key here (`grup_size`); '' otherwise."""
    import difflib

    if not isinstance(key, str):  # e.g. a YAML key `1:` or `yes:`
        return ""
    here = [f.name for f in dataclasses.fields(obj)]
    below = [f"{f.name}.{key}" for f in dataclasses.fields(obj) if dataclasses.is_dataclass(getattr(obj, f.name))
             and key in {g.name for g in dataclasses.fields(getattr(obj, f.name))}]
    guesses = below or difflib.get_close_matches(key, here, n=1)
    return f" (did you mean {' or '.join(prefix + g for g in guesses)}?)" if guesses else ""


def apply_dict(obj: Any, updates: dict, prefix: str = "") -> None:
    """Merge a nested dict into the dataclass tree `obj` in place.

    Raises ConfigError naming the dotted key for an unknown key or a wrong type.
    """
    if not isinstance(updates, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(updates).__name__}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in updates.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}{_did_you_mean(obj, key, prefix)}; "
                              f"valid keys here: {', '.join(sorted(names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            apply_dict(current, value, dotted + ".")
            continue
        ok, coerced = _type_ok(value, hints[key])
        if not ok:
            raise ConfigError(f"config key {dotted!r}: expected {_describe(hints[key])}, got {value!r} "
                              f"({type(value).__name__})")
        if isinstance(current, dict) and isinstance(coerced, dict):
            coerced = {**current, **coerced}
        setattr(obj, key, coerced)


def parse_override(text: str) -> dict:
    """Turn ``"algorithm.clip_high=0.3"`` into ``{"algorithm": {"clip_high": 0.3}}``.

    The value is read as YAML (numbers, true/false, null, [lists] work). Raises ConfigError
    when there is no ``=`` or the key is empty.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({str(e).splitlines()[0]}; quote the "
                          "whole override for the shell if it holds spaces)") from None
    if isinstance(value, str):
        # YAML 1.1 reads "1e-5" (no dot) as a string; a number is what anyone means
        try:
            value = float(value) if not value.strip().lower() in ("nan", "inf", "-inf", ".inf") else value
        except ValueError:
            pass
    return _nested(key, value)


def _nested(key: str, value: Any) -> dict:
    """``("a.b.c", v)`` -> ``{"a": {"b": {"c": v}}}``."""
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def validate(cfg: TrainConfig) -> TrainConfig:
    """Refuse impossible values with a ConfigError naming the key; returns `cfg`."""
    r, a, o, t = cfg.rollout, cfg.algorithm, cfg.optim, cfg.trainer

    def need(cond: bool, key: str, value: Any, why: str) -> None:
        if not cond:
            raise ConfigError(f"config key {key!r} = {value!r}: {why}")

    for section in (cfg.model, cfg.env, r, a, o, t):
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            vals = v if isinstance(v, list) else [v]
            if any(isinstance(x, float) and not math.isfinite(x) for x in vals):
                name = {id(cfg.model): "model", id(cfg.env): "env", id(r): "rollout", id(a): "algorithm",
                        id(o): "optim", id(t): "trainer"}[id(section)]
                raise ConfigError(f"config key '{name}.{f.name}' = {v!r}: must be a finite number")
    # single-field rules live on the fields (`checked`); what follows relates fields
    for section, name in ((cfg.model, "model"), (cfg.env, "env"), (r, "rollout"), (a, "algorithm"), (o, "optim"),
                          (t, "trainer")):
        check_fields(section, f"{name}.")
    need(r.max_new_tokens < r.max_context, "rollout.max_new_tokens", r.max_new_tokens,
         f"must be below rollout.max_context ({r.max_context})")
    need(r.engine == "native" or cfg.model.lora_rank == 0, "rollout.engine", r.engine,
         "the SGLang engine takes full weights; LoRA (model.lora_rank > 0) needs rollout.engine=native")
    need(a.clip_high >= a.clip_low, "algorithm.clip_high", a.clip_high,
         f"must be >= algorithm.clip_low ({a.clip_low})")
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
    _check_env_options(cfg.env.name, cfg.env.options)
    return cfg


def _check_off_policy(cfg: TrainConfig, need) -> None:
    """Rollout reuse, replay and the importance-sampling correction (issue 13's keys)."""
    a = cfg.algorithm
    need(not (a.ratio_level == "sequence" and a.is_correction != "none" and a.is_level == "token"),
         "algorithm.is_level", a.is_level,
         f"contradicts algorithm.ratio_level='sequence' (GSPO) with is_correction={a.is_correction!r}: a "
         "trajectory's one ratio cannot take per-token weights; use algorithm.is_level=sequence")


def _check_env_options(name: str, options: dict) -> None:
    """Dry run: build one instance of env `name` with `options` (no model; cheap). Sokoban with
    non-default options also resets it once (under a second), which finds impossible levels
    such as more boxes than a room holds.

    Raises ConfigError naming `env.options` for an unknown key or a bad value.
    """
    from fastpo.envs_native import make_env

    try:
        env = make_env(name, 1, **options)
        if name == "sokoban" and options:
            env.reset([0])
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"config key 'env.options' = {options!r} for env {name!r}: {e}") from None


def load_config(env: Optional[str] = None, preset: Optional[str] = None, file: Optional[str] = None,
                overrides: Optional[list[str]] = None, values: Optional[dict] = None) -> TrainConfig:
    """Build and validate a TrainConfig: defaults -> named presets -> env preset -> YAML -> overrides.

    `preset` may be several comma-separated names applied in order (e.g. "cpu,grpo"); None
    means `default_preset()`. A YAML file may itself name `env` and `preset`; the command
    line's win. `values` maps dotted keys to values taken literally, not parsed as YAML (what
    --model and --out give: a path may hold '#', ':' or digits only); applied before `overrides`.
    Raises ConfigError (ValueError) naming the bad key or value; FileNotFoundError
    for a missing file.
    """
    file_dict = read_config_file(file) if file else {}
    override_dicts = [parse_override(o) for o in (overrides or [])]
    for d in override_dicts:
        if "preset" in d:  # applying it would only relabel the run, not apply the preset's settings
            raise ConfigError(f"override 'preset={d['preset']}': presets are chosen with --preset NAME[,NAME...] "
                              "(or `preset:` in a config file), not as a dotted override")
    env_name = env or _dig(override_dicts, ("env", "name")) or (file_dict.get("env") or {}).get("name") or "frozenlake"
    if env_name not in ENV_PRESETS:
        raise ConfigError(f"unknown env {env_name!r}; choose from {', '.join(ENV_PRESETS)}")
    preset_names = preset or file_dict.pop("preset", None) or default_preset()
    file_dict.pop("preset", None)
    cfg = TrainConfig()
    cfg.env.name = env_name
    names = [p.strip() for p in str(preset_names).split(",") if p.strip()]
    if not names:
        raise ConfigError(f"preset {preset_names!r} names no preset; choose from {', '.join(PRESETS)}")
    for name in names:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        apply_dict(cfg, PRESETS[name])
    apply_dict(cfg, ENV_PRESETS[env_name])
    cfg.preset = ",".join(names)
    apply_dict(cfg, file_dict)
    for key, value in (values or {}).items():
        apply_dict(cfg, _nested(key, value))
    for d in override_dicts:
        apply_dict(cfg, d)
    if env and cfg.env.name != env:
        cfg.env.name = env
    if not cfg.trainer.output_dir:
        cfg.trainer.output_dir = f"runs/{cfg.env.name}"
    return validate(cfg)


def parse_config_yaml(text: Any, where: str) -> dict:
    """The mapping in config YAML `text` (a string or an open file): the one reader of
    config files, run folders' and checkpoints' config.yaml. An empty document is {}.

    Raises ConfigError naming `where`: invalid YAML or a top level that is not a mapping.
    """
    try:
        d = yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: the top level must be a mapping, got {type(d).__name__}")
    return d


def read_config_file(file: str) -> dict:
    """The mapping in YAML config file `file`; `env: NAME` (a string) is read as `env: {name: NAME}`.

    Raises FileNotFoundError for a missing file, ConfigError for an unreadable one, invalid
    YAML, a top level that is not a mapping or an `env` that is neither a mapping nor a name.
    """
    try:
        with open(file) as f:
            d = dict(parse_config_yaml(f, f"config file {file}"))
    except FileNotFoundError:
        raise
    except OSError as e:  # a folder, no permission, ...
        raise ConfigError(f"config file {file}: cannot read it ({e.strerror or e})") from None
    if isinstance(d.get("env"), str):
        d["env"] = {"name": d["env"]}
    elif d.get("env") is not None and not isinstance(d["env"], dict):
        raise ConfigError(f"config file {file}: 'env' must be an env name or a mapping such as "
                          f"{{name: frozenlake, options: {{}}}}, got {d['env']!r}")
    return d


def read_run_config(path: str) -> TrainConfig:
    """The validated TrainConfig in a run's (or a checkpoint's) config.yaml at `path`.

    Raises FileNotFoundError when it is missing; ConfigError when it cannot be read, is not
    valid YAML or not a valid fastpo configuration (each naming `path`).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {os.path.dirname(path) or '.'} a fastpo run folder?")
    try:
        with open(path) as f:
            d = parse_config_yaml(f, path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the run's configuration ({e.strerror or e})") from None
    try:
        return config_from_dict(d)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: not a valid fastpo configuration ({e})") from None


def load_run_config(out_dir: str) -> TrainConfig:
    """The configuration a run was started with (`OUT/config.yaml`, `read_run_config`)."""
    return read_run_config(os.path.join(out_dir, "config.yaml"))


def run_settings(config_yaml: str) -> dict:
    """A run's settings from its config.yaml text, without what a resume may change freely
    (the folder's spelling, the iteration count): two runs with equal settings train alike.
    Raises ConfigError for text that is not a YAML mapping."""
    d = parse_config_yaml(config_yaml, "config.yaml")
    for key in ("output_dir", "iterations"):
        (d.get("trainer") or {}).pop(key, None)
    return d


def config_from_dict(d: dict) -> TrainConfig:
    """Rebuild a validated TrainConfig from `TrainConfig.to_dict()` output (used on resume)."""
    cfg = TrainConfig()
    apply_dict(cfg, d)
    return validate(cfg)


def _dig(dicts: list[dict], path: tuple[str, ...]) -> Any:
    found = None
    for d in dicts:
        node: Any = d
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
        if node is not None:
            found = node
    return found


def dump_yaml(cfg: TrainConfig) -> str:
    """The configuration as YAML text (what `OUT/config.yaml` holds)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
