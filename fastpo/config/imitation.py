"""The sections of the imitation-learning commands: `sft` (`fastpo sft` and `fastpo dagger`:
the supervised data) and `dagger` (`fastpo dagger`: its rounds), each key documented beside its
field.

A `fastpo train` or `fastpo eval` configuration has neither section (`TrainConfig.sft` and
`TrainConfig.dagger` are None, and its config.yaml has no such key); `load_config(...,
sections=("sft",))` gives one with the defaults below, then the presets, the config file and
the dotted overrides (`sft.trajectories=256`) fill it like any other section. Their rules
relating keys are `check_imitation` (fastpo.config.validation); a layer that sets a section
the command does not read is refused in loading (`refuse_sections`), where a run folder made
before config.yaml held them is read too (`legacy_sections`).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastpo.config.fields import at_least, checked

#: The optional sections of TrainConfig, in the order config.yaml writes them.
OPTIONAL_SECTIONS = ("sft", "dagger")


@dataclass
class SFTConfig:
    """The `sft` section: what `fastpo sft` (and round 0 of `fastpo dagger`) trains on."""

    data: str = checked(
        "", lambda v: isinstance(v, str), "must be a path to a JSONL file of chat messages",
        doc='a JSONL file of conversations (`{"messages": [{"role": ..., "content": ...}, ...]}` per line, TRL\'s '
            'conversational format) to train on instead of the expert\'s trajectories ("" = the expert); '
            "trajectories, seed_offset and actions_per_turn are then not read. The run keeps it as an absolute path, "
            "with its SHA-256 in data_sha256: a resume refuses a file that changed.")
    data_sha256: str = checked(
        "", lambda v: isinstance(v, str), "must be text (set by the run)",
        doc='the SHA-256 of `data` (hex), set by the run; "" for the expert.')
    trajectories: int = checked(
        128, at_least(1), "must be >= 1",
        doc="expert trajectories in the data set, one per env seed seed_offset, seed_offset + 1, ... (refused when "
            "they overlap the eval seeds).")
    batch_size: int = checked(
        8, at_least(1), "must be >= 1",
        doc="trajectories (or conversations) per optimizer step, one trainer iteration; at most the size of the data.")
    seed_offset: int = checked(0, lambda v: 0 <= v < 2**31, "must be in [0, 2**31)", doc="the first expert seed.")
    actions_per_turn: int = checked(
        0, at_least(0), "must be >= 0 (0 = the game's own count)",
        doc="the expert's actions per answer, capped by rollout.max_actions_per_turn and the actions left; 0 = the "
            "game's own count (FrozenLake: 1, so that every cell the expert acts on is shown to the model), else "
            "rollout.max_actions_per_turn.")
    common_prefix: bool = checked(
        True, lambda v: isinstance(v, bool), "must be true or false",
        doc="pack a micro-batch's trajectories after one copy of the leading tokens they all share (at least 16: "
            "chat header, system prompt, instructions), computed once per micro-batch (optim.share_prefix, "
            '"segments" attention; the same loss and gradients up to float rounding).')

    def seeds(self) -> list[int]:
        """The expert's env seeds: seed_offset, seed_offset + 1, ... (trajectories of them)."""
        return list(range(self.seed_offset, self.seed_offset + self.trajectories))


@dataclass
class DaggerConfig:
    """The `dagger` section: the rounds of `fastpo dagger` (DAgger, Ross, Gordon & Bagnell 2011)."""

    rounds: int = checked(
        3, at_least(1), "must be >= 1",
        doc="DAgger rounds after the SFT round (round k's model plays, round k + 1 learns from it); `--rounds N`, "
            "and on --resume a larger N runs more.")
    levels: int = checked(
        256, at_least(1), "must be >= 1",
        doc="training levels (env seeds) each round plays, one trajectory each: round k plays seed_offset + (k - 1) "
            "* levels .. seed_offset + k * levels - 1 (refused when they overlap the eval seeds).")
    seed_offset: int = checked(0, lambda v: 0 <= v < 2**31, "must be in [0, 2**31)", doc="the first level of round 1.")
    temperature: float = checked(
        0.5, lambda v: 0 <= v <= 10, "must be in [0, 10] (0 = greedy)",
        doc="the rounds' rollout sampling temperature (0.5, the paper's eval temperature; 0 = greedy).")
    history: str = checked(
        "own", lambda v: v in ("own", "expert"), "must be 'own' or 'expert'",
        doc='"own" (one conversation per labelled turn, the model\'s own earlier answers as context of weight 0 and '
            'the label as the one target) or "expert" (one conversation per trajectory, every answer replaced by its '
            "label).")
    turns_per_trajectory: int = checked(
        2, at_least(0), "must be >= 0 (0 = every labelled turn)",
        doc='with "own", the labelled turns kept per trajectory, drawn at random (0 = all).')
    expert_trajectories: int = checked(
        0, at_least(0), "must be >= 0",
        doc="the expert's own trajectories on the first N levels of each round, added to its data (at most `levels`).")
    aggregate: bool = checked(
        False, lambda v: isinstance(v, bool), "must be true or false",
        doc="train round k on rounds 1..k's data (DAgger's rule) instead of round k's alone.")
    steps: int = checked(
        0, at_least(0), "must be >= 0 (0 = one epoch of the round's data)",
        doc="optimizer steps per round (0 = one epoch of its data, sft.batch_size conversations a step).")
    lr: float = checked(
        0.0, lambda v: 0 <= v < 1, "must be in [0, 1) (0 = optim.actor_lr)",
        doc="the rounds' learning rate (0 = optim.actor_lr, round 0's).")
    sft_round: bool = checked(
        True, lambda v: isinstance(v, bool), "must be true or false",
        doc="run round 0, SFT on the expert's trajectories (the `sft` section); false starts round 1 from model.name "
            "as it is (e.g. a `fastpo sft` run).")
    chunk: int = checked(
        128, at_least(1), "must be >= 1",
        doc="trajectories rolled out at once (the KV cache of a chunk bounds the rollout's memory; a stopped rollout "
            "keeps its finished chunks).")

    def round_levels(self, k: int) -> list[int]:
        """The env seeds round k >= 1 plays."""
        lo = self.seed_offset + (k - 1) * self.levels
        return list(range(lo, lo + self.levels))


#: The dataclass of each optional section.
SECTION_TYPES = {"sft": SFTConfig, "dagger": DaggerConfig}


def add_sections(cfg, names) -> None:
    """Give TrainConfig `cfg` the optional sections `names` (their defaults) it lacks."""
    for name in names:
        if name not in OPTIONAL_SECTIONS:
            raise ValueError(f"unknown optional section {name!r}; choose from {OPTIONAL_SECTIONS}")
        if getattr(cfg, name) is None:
            setattr(cfg, name, SECTION_TYPES[name]())


