"""What `fastpo sft` and `fastpo dagger` add to the one configuration (fastpo.config, whose
`sft` and `dagger` sections hold their settings): the defaults they set over the presets
(`SFT_DEFAULT_OVERRIDES`, `sft_default_overrides`), the preset a new run takes
(`imitation_preset`: the game recipes of fastpo.config.presets on the CPU), and the StarPO
command that continues from an SFT model with the settings it learnt (`handoff_command`).
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

import yaml

from fastpo.config.files import flatten
from fastpo.config.loading import load_config
from fastpo.config.presets import PRESETS, RECIPE_PRESETS, command_default_preset
from fastpo.config.schema import TrainConfig

#: What `fastpo sft` (and round 0 of `fastpo dagger`) sets over the presets, before your
#: overrides (which win): the run's length and checkpoints, one evaluation before and one after
#: training, lr for SFT (1e-4: at 1e-5 a small budget hardly moves the model; docs/sft.md, "The
#: default learning rate"). A game recipe preset (`sokoban-sft`, ...) keeps the keys it sets.
SFT_DEFAULT_OVERRIDES = ["trainer.iterations=32", "trainer.eval_every=1000000", "trainer.save_every=16",
                         "optim.actor_lr=1e-4", "trainer.eval_before_training=true"]


def sft_default_overrides(presets: list[str], command: str = "sft") -> list[str]:
    """SFT_DEFAULT_OVERRIDES for a run of `fastpo COMMAND` on `presets` (their names), without
    the keys a game recipe among them sets (its measured values stand) and, for `fastpo sft`,
    those of the `tiny` preset's trainer section: a smoke run in every command keeps its own run
    length and checkpoints (2 steps) instead of SFT's 32."""
    kept: set = set()
    for name in presets:
        if name in RECIPE_PRESETS:
            kept |= set(flatten(PRESETS[name]))
    if command == "sft" and "tiny" in presets:
        kept |= {f"trainer.{k}" for k in PRESETS["tiny"]["trainer"]}
    return [o for o in SFT_DEFAULT_OVERRIDES if o.split("=", 1)[0] not in kept]


def imitation_preset(command: str, env: Optional[str], preset: Optional[str], config_file: Optional[str]):
    """The --preset value a new run of `fastpo COMMAND` ("sft" or "dagger") takes: `preset` as
    given; None with a config file (its `preset:` or this machine's default); else this
    machine's default with, on the CPU, the game's recipe (`command_default_preset`:
    `fastpo sft --env sokoban` -> "cpu,sokoban-sft")."""
    if preset is not None or config_file is not None:
        return preset
    return command_default_preset(command, env)


def handoff_command(cfg: TrainConfig) -> str:
    """`fastpo train --env ENV --model OUT ...`: RL from an SFT run's model, with the game's
    options and the rollout settings that run used where `fastpo train --env ENV` (the run's
    presets but the imitation recipes) would use others: the model was trained on that
    rendering and format (`train --model` takes the weights, not the settings)."""
    def value(v) -> str:  # as the dotted overrides read it back (YAML): quoted text, flow lists
        if isinstance(v, str):
            return yaml.safe_dump(v, default_style='"', width=float("inf")).strip()
        return yaml.safe_dump(v, default_flow_style=True, width=float("inf")).removesuffix("\n...\n").strip()

    starpo = ",".join(p for p in cfg.preset.split(",") if p.strip() not in RECIPE_PRESETS) or None
    plain = load_config(env=cfg.env.name, preset=starpo, check_env=False)
    over = [f"env.options.{k}={value(v)}" for k, v in sorted(cfg.env.options.items())
            if plain.env.options.get(k) != v]
    for f in dataclasses.fields(cfg.rollout):
        v = getattr(cfg.rollout, f.name)
        if v != getattr(plain.rollout, f.name):
            over.append(f"rollout.{f.name}={value(v)}")
    return " ".join(["fastpo train", "--env", shlex.quote(cfg.env.name), "--model",
                     shlex.quote(cfg.trainer.output_dir), *(shlex.quote(o) for o in over)])
