"""The batch record: the trajectories one update trains on, and everything scored about them.

`TrainBatch` holds one entry per trajectory in each field (a 1-D tensor over its T_i tokens,
token t at index t), so that selecting or concatenating trajectories keeps the fields
together: filtering (StarPO-S, the "mis" correction), replay and reuse (fastpo.trainer.replay's
items are its rows), packing and the update all read it. Fields that a run does not have
(values without a critic, reference log-probs without a KL term, the context window's labels
with a full context) are None.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

#: replay item key <- field (the keys fastpo.trainer.replay's checkpoints hold)
_ITEM_KEYS = {"input_ids": "input_ids", "loss_mask": "loss_mask", "sample_logprobs": "sample_logprobs",
              "old_logprobs": "old_logprobs", "advantages": "advantages", "returns": "returns", "values": "values",
              "ref_logprobs": "ref_logprobs", "context_turns": "context_turns", "visible_from": "visible_from"}


@dataclass
class TrainBatch:
    """B trajectories in training; every field a list of B per-trajectory 1-D CPU tensors.

    input_ids: [T_i] int64 token ids. loss_mask: [T_i] bool, the tokens the loss scores (model
    tokens; never token 0, which has no predecessor). sample_logprobs: [T_i] fp32, the
    sampler's log-probs (at the rollout temperature; 0 off the mask). old_logprobs: [T_i]
    fp32, PPO's ratio anchor (the sampler's or recomputed). entropies: [T_i] fp32 (nats) of
    the policy that gave old_logprobs. advantages, returns, values: [T_i] fp32 (returns and
    values: with a critic). ref_logprobs: [T_i] fp32, the frozen reference model's (KL
    term). is_weights: [T_i] fp32 importance-sampling weights (algorithm.is_correction).
    context_turns, visible_from: [T_i] int64, the context window's per-token turn label and
    the first turn that token's query sees (fastpo/rollout/window.py); None with a full context.
    sampled_at: the iteration that sampled each trajectory (replay's age).
    """

    input_ids: list
    loss_mask: list
    sample_logprobs: list
    sampled_at: list
    old_logprobs: Optional[list] = None
    entropies: Optional[list] = None
    advantages: Optional[list] = None
    returns: Optional[list] = None
    values: Optional[list] = None
    ref_logprobs: Optional[list] = None
    is_weights: Optional[list] = None
    context_turns: Optional[list] = None
    visible_from: Optional[list] = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @classmethod
    def from_rollout(cls, rollout, iteration: int) -> "TrainBatch":
        """The record of a rollout's `TrajectoryBatch` (sampled in `iteration`): its ids, loss
        masks (token 0 unscored), sampler log-probs and, with a context window, its labels."""
        ids = [torch.as_tensor(x, dtype=torch.long) for x in rollout.input_ids]
        masks = [torch.as_tensor(x, dtype=torch.bool).clone() for x in rollout.loss_mask]
        for m in masks:
            m[0] = False
        windowed = bool(rollout.context_turns)
        return cls(ids, masks, [torch.as_tensor(x, dtype=torch.float32) for x in rollout.sample_logprobs],
                   [int(iteration)] * len(ids),
                   context_turns=[torch.as_tensor(x, dtype=torch.long) for x in rollout.context_turns] if windowed
                   else None,
                   visible_from=[torch.as_tensor(x, dtype=torch.long) for x in rollout.visible_from] if windowed
                   else None)

    def window(self, i: int):
        """(turn, visible_from) labels of trajectory i for packing, or None (full context)."""
        return None if self.context_turns is None else (self.context_turns[i], self.visible_from[i])

    def select(self, indices: Sequence[int]) -> "TrainBatch":
        """The trajectories `indices` (in that order), every field with them."""
        idx = [int(i) for i in indices]
        return dataclasses.replace(self, **{f.name: None if getattr(self, f.name) is None
                                            else [getattr(self, f.name)[i] for i in idx]
                                            for f in dataclasses.fields(self)})

    @classmethod
    def concat(cls, parts: Sequence["TrainBatch"]) -> "TrainBatch":
        """The trajectories of `parts` in order. A field present in some parts and not in others
        is a ValueError naming it (e.g. values from a run with a critic and one without)."""
        if not parts:
            raise ValueError("TrainBatch.concat needs at least one part")
        out = {}
        for f in dataclasses.fields(cls):
            cols = [getattr(p, f.name) for p in parts]
            if all(c is None for c in cols):
                out[f.name] = None
            elif any(c is None for c in cols):
                raise ValueError(f"TrainBatch.concat: field {f.name!r} is in some parts and not in others")
            else:
                out[f.name] = [x for c in cols for x in c]
        return cls(**out)

    def rows(self) -> list[dict]:
        """One dict per trajectory of what training on it again needs (fastpo.trainer.replay's items:
        CPU tensors and the sampling iteration as "iteration")."""
        items = []
        for i in range(len(self)):
            item = {key: getattr(self, f)[i] for key, f in _ITEM_KEYS.items() if getattr(self, f) is not None}
            item["iteration"] = self.sampled_at[i]
            items.append(item)
        return items

    @classmethod
    def from_rows(cls, items: Sequence[dict]) -> "TrainBatch":
        """The record of replay items (`rows`); fields the items lack are None."""
        def col(key):
            return [x[key] for x in items] if items and key in items[0] else None

        kw = {f: col(key) for key, f in _ITEM_KEYS.items()}
        for f in ("input_ids", "loss_mask", "sample_logprobs", "old_logprobs", "advantages"):
            kw[f] = kw[f] or []
        return cls(sampled_at=[int(x["iteration"]) for x in items], **kw)
