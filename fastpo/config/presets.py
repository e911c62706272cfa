"""The named presets (`--preset paper|cpu|starpo|grpo|tiny`, and the game recipes of `fastpo
sft` and `fastpo dagger`: `sokoban-sft`, `frozenlake-dagger`; applied after the defaults and
before the environment's preset, the config file and the overrides), what the CPU preset
scaled down (`cpu_preset_note`), and the default preset of this machine and of each command
(`default_preset`, `command_default_preset`)."""
from __future__ import annotations

from fastpo.config.schema import TrainConfig
from fastpo.registry import estimator

#: Named presets. "paper" is the defaults; "cpu" is sized to finish `fastpo train --env
#: frozenlake` on 2 cores in under 10 minutes.
PRESETS: dict[str, dict] = {
    "paper": {},
    # measured choices: docs/results.md, how the preset was chosen (answer-only with answer examples, Dr.GRPO, 64 eval
    # seeds before and after)
    "cpu": {
        # activations recomputed in the backward (as verl's default): a 2048-token micro-batch's
        # ~3 GiB of them kept the main job's peak at twice its model state (docs/performance.md)
        "model": {"gradient_checkpointing": True},
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
    # The game recipes of the imitation commands (RECIPES), set over `fastpo sft`'s own defaults
    # (fastpo.sft.config.sft_default_overrides). Sokoban SFT, the best measured setting on the CPU
    # (docs/sft.md, "1,536 levels"): one move per answer (and a prompt saying so), closed loop,
    # over 10 turns; 1,536 expert levels for one epoch (192 steps of 8) at lr 2e-4.
    "sokoban-sft": {
        "rollout": {"max_turns": 10, "max_actions_per_traj": 10, "max_actions_per_turn": 1},
        "optim": {"actor_lr": 2e-4},
        "trainer": {"iterations": 192},
        "sft": {"actions_per_turn": 1, "trajectories": 1536},
    },
    # FrozenLake DAgger, the measured chain (docs/sft.md, "FrozenLake: the states the model reaches
    # itself"): the coordinate observation, one move per answer over 10 turns, round 0 on 768
    # expert levels (96 steps of 8 at lr 2e-4), then rounds at lr 1e-4.
    "frozenlake-dagger": {
        "env": {"options": {"observation": "coords"}},
        "rollout": {"max_turns": 10, "max_actions_per_traj": 10, "max_actions_per_turn": 1, "max_context": 2048},
        "optim": {"actor_lr": 2e-4},
        "trainer": {"iterations": 96},
        "sft": {"actions_per_turn": 1, "trajectories": 768},
        "dagger": {"lr": 1e-4},
    },
}

#: The recipe preset each imitation command adds, per game, where the machine's default preset
#: is `cpu` and neither --preset nor --config is given (`command_default_preset`): `fastpo sft
#: --env sokoban` runs `--preset cpu,sokoban-sft`.
RECIPES: dict[str, dict[str, str]] = {
    "sft": {"sokoban": "sokoban-sft"},
    "dagger": {"frozenlake": "frozenlake-dagger", "sokoban": "sokoban-sft"},
}
#: The recipe presets (they set an imitation section: `fastpo sft` and `fastpo dagger` only).
RECIPE_PRESETS = tuple(sorted({name for per_game in RECIPES.values() for name in per_game.values()}))

#: What the CPU preset changes, said at start.
def cpu_preset_note(cfg: TrainConfig) -> str:
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
        f"{r.max_new_tokens} new tokens/turn, {prompt}, temperature {r.temperature:g}, {t.iterations} iteration{'s' if t.iterations != 1 else ''}, "
        f"{filt}, {critic}, actor lr {o.actor_lr:g}, {evals}. For the paper's scale use `--preset paper` on a GPU "
        "(and `--model Qwen/Qwen2.5-0.5B-Instruct` where that model is available)."
    )


def command_default_preset(command: str, env) -> str:
    """The preset of `fastpo COMMAND --env ENV` given neither --preset nor --config:
    `default_preset()`, followed on the CPU by the game's recipe for the command (RECIPES:
    "cpu,sokoban-sft" for `fastpo sft --env sokoban`)."""
    base = default_preset()
    recipe = RECIPES.get(command, {}).get(env) if base == "cpu" else None
    return f"{base},{recipe}" if recipe else base


def preset_help(command: str) -> str:
    """The --preset help of `fastpo COMMAND`: the preset names and the default."""
    names = [n for n in PRESETS if n not in RECIPE_PRESETS or n in RECIPES.get(command, {}).values()]
    recipes = RECIPES.get(command, {})
    extra = "".join(f"; `--env {game}` adds {name} on the CPU" for game, name in recipes.items())
    return f"named preset(s), comma-separated: {', '.join(names)} (default: paper with a GPU, cpu without{extra})"


def default_preset() -> str:
    """"paper" when CUDA is available, else "cpu"."""
    try:
        import torch

        return "paper" if torch.cuda.is_available() else "cpu"
    except Exception:  # torch missing or broken: the CPU preset is the safe choice
        return "cpu"
