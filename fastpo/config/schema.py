"""The training configuration's schema: a tree of dataclasses (`TrainConfig` at the root, one
field per section) with the paper's defaults, each key's documentation beside its field
(`key` / `checked` doc=) and its own rule (`checked`), and the values derived from the keys
(`TrainConfig.train_batch_size`, `eval_seeds`, ...).

Defaults are the RAGEN paper's (arXiv 2504.20073, Sec. 5 and App. B): 8 env groups x 16
trajectories, 5 turns, 10 actions, PPO mini-batch 32, GAE gamma = lambda = 1, entropy
coefficient 0.001, actor lr 1e-6, critic lr 1e-5, grad clip 1.0, 200 iterations, eval on 256
fixed seeds at temperature 0.5 every 10 iterations, StarPO-S (top-25% reward-std filtering, no
KL, clip-higher 0.2 / 0.28).

The `algorithm` section is fastpo.config.algorithm, the `sft` and `dagger` sections
fastpo.config.imitation; building a configuration is fastpo.config.loading, the rules relating
keys fastpo.config.validation.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

from fastpo.config.algorithm import AlgorithmConfig
from fastpo.config.fields import Rule, as_dict, at_least, check_fields, checked, key
from fastpo.config.imitation import OPTIONAL_SECTIONS, DaggerConfig, SFTConfig
from fastpo.registry import estimator

#: Upper bound on rollout.max_actions_per_turn (the paper uses 5; more only pads the prompt).
MAX_ACTIONS_PER_TURN = 64

# Sampling rules shared by the rollout config and the engine's SamplingParams.
TOP_P_RULE = Rule(lambda v: 0 < v <= 1, "must be in (0, 1]")
TOP_K_RULE = Rule(lambda v: v >= 0, "must be >= 0 (0 = off)")


def _window_ok(value: Any) -> bool:
    """rollout.context_window: "full" or an int K >= 1 (the type is checked before)."""
    return value == "full" if isinstance(value, str) else (not isinstance(value, bool) and value >= 1)


CONTEXT_WINDOW_WHY = "must be 'full' or an integer K >= 1 (the last K turns kept)"


def _seed_range(v: Any) -> bool:  # env and torch seeds are 32-bit
    return 0 <= v < 2**32


@dataclass
class ModelConfig:
    """The `model` section: which policy model to train, and how (full weights or LoRA)."""

    name: str = checked(
        "smollm2-135m-instruct", bool, "must not be empty",
        doc='the model: "smollm2-135m-instruct" (embedded, the default), an HF hub id, a local model folder, a '
            'fastpo checkpoint or run folder, or "random:<shape>" (a known architecture with random weights: '
            "tiny-llama, smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b; fastpo.model_loading).")
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

