"""A bounded replay buffer of trajectories from older policies (RAGEN's replay, arXiv 2504.20073).

`rollout.replay = N` keeps the trajectories of the last N rollout batches; each update mixes
`rollout.replay_fraction` x (fresh batch size) of them, drawn uniformly, into its batch.
They were sampled by older policies, so the trainer recomputes their old log-probs with
the current one and corrects the sampler gap with `fastpo.algorithms.rollout_correction`
(their sampler log-probs are stored with them).

The buffer only stores and draws; what a trajectory holds (token ids, loss mask, sampler
log-probs, advantages, the iteration that sampled it, ...) is up to the caller: each item
is a dict of CPU tensors and plain numbers. Memory is bounded by a count of trajectories;
when full, the oldest are dropped first. `state_dict` / `load_state_dict` carry it through
checkpoints (plain containers, tensors and numbers: loadable with torch.load(weights_only=True)).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _cpu_copy(item: dict) -> dict:
    if not isinstance(item, dict):
        raise TypeError(f"a replay item must be a dict of tensors and numbers, got {type(item).__name__}")
    out = {}
    for k, v in item.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().to("cpu", copy=True)
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        else:
            raise TypeError(f"replay item field {k!r} must be a tensor or a number, got {type(v).__name__}")
    return out


class ReplayBuffer:
    """First-in first-out store of at most `capacity` trajectories, drawn uniformly.

    capacity: trajectories kept (>= 0; 0 keeps nothing). `add` appends (copies to the CPU)
    and drops the oldest beyond capacity; `sample(k, generator)` draws min(k, len) distinct
    items uniformly with the given torch.Generator (so a resumed run draws the same).
    Raises ValueError for a negative capacity or k, TypeError for an item that is not a
    dict of tensors and numbers.
    """

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"replay buffer capacity must be an integer >= 0 (trajectories), got {capacity!r}")
        self._capacity = capacity
        self._items: list[dict] = []
        self._added = 0  # trajectories ever added
        self._dropped = 0  # trajectories dropped because the buffer was full

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def added(self) -> int:
        """Trajectories ever added (kept or since dropped)."""
        return self._added

    @property
    def dropped(self) -> int:
        """Trajectories dropped, oldest first, to stay within capacity."""
        return self._dropped

    def __len__(self) -> int:
        return len(self._items)

    def add(self, items: Iterable[dict]) -> int:
        """Append `items` (oldest first); returns how many old ones were dropped to make room."""
        new = [_cpu_copy(it) for it in items]
        self._added += len(new)
        self._items.extend(new)
        drop = max(0, len(self._items) - self._capacity)
        if drop:
            del self._items[:drop]
            self._dropped += drop
        return drop

    def sample(self, k: int, generator: torch.Generator) -> list[dict]:
        """min(k, len) distinct items drawn uniformly (in the drawn order); the stored items
        themselves, not copies: do not modify them."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"number of replayed trajectories must be an integer >= 0, got {k!r}")
        k = min(k, len(self._items))
        if k == 0:
            return []
        idx = torch.randperm(len(self._items), generator=generator)[:k].tolist()
        return [self._items[i] for i in idx]

    def items(self) -> list[dict]:
        """Every stored item, oldest first (the stored objects)."""
        return list(self._items)

    def state_dict(self) -> dict[str, Any]:
        return {"capacity": self._capacity, "items": list(self._items), "added": self._added,
                "dropped": self._dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`. The stored items are kept up to this buffer's capacity
        (the newest, when a resumed run lowered rollout.replay). Raises ValueError on a
        state that is not one."""
        if not isinstance(state, dict) or not {"capacity", "items", "added"} <= set(state):
            raise ValueError("not a ReplayBuffer state_dict (needs capacity, items, added)")
        items = [_cpu_copy(it) for it in state["items"]]
        self._items = []
        self._added = int(state["added"]) - len(items)
        self._dropped = int(state.get("dropped", 0))
        self.add(items)
