"""A bounded replay buffer of trajectories from older policies (RAGEN's replay, arXiv 2504.20073).

`rollout.replay = N` keeps the trajectories of the last N rollout batches; each update mixes
`rollout.replay_fraction` x (fresh batch size) of them, drawn uniformly, into its batch.
They were sampled by older policies, so the trainer recomputes their old log-probs with
the current one and corrects the sampler gap with `fastpo.algorithms.rollout_correction`
(their sampler log-probs are stored with them): `off_policy_batch`.

The buffer only stores and draws; what a trajectory holds (token ids, loss mask, sampler
log-probs, advantages, the iteration that sampled it, ...) is up to the caller: each item
is a dict of CPU tensors and plain numbers. Memory is bounded by a count of trajectories;
when full, the oldest are dropped first. `state_dict` / `load_state_dict` carry it through
checkpoints (plain containers, tensors and numbers: loadable with torch.load(weights_only=True)).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import torch

from fastpo import algorithms as alg
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.metric_sums import MetricSums


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


def _draw(items: list, k: int, generator: torch.Generator) -> list:
    """min(k, len(items)) distinct items, uniformly, in the drawn order."""
    k = min(k, len(items))
    if k == 0:
        return []
    return [items[i] for i in torch.randperm(len(items), generator=generator)[:k].tolist()]


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
        return _draw(self._items, k, generator)

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


class RolloutSchedule:
    """When to roll out, what to reuse and what to replay: RAGEN's Online-K and replay buffer.

    reuse K >= 1: iteration `it` (from 1) rolls out when (it - 1) % K == 0 (or when nothing is
    held, e.g. the first iteration of a run); the K - 1 iterations after it train again on
    that batch (`current`), whose items keep the old log-probs of the policy that sampled
    them. replay N >= 0 batches: when a new batch starts, the previous one goes into a
    ReplayBuffer of N x batch_size trajectories (so the buffer never holds the batch being
    trained on), and each iteration draws round(fraction x its batch size) of them
    (`replayed`), with a generator seeded from (seed, it), so a resumed run draws the same.

    A batch is a list of items, one per trajectory (dicts of CPU tensors and numbers, see
    ReplayBuffer), with the metrics of its rollout (`metrics`, logged again by the
    iterations that reuse it). `state_dict` holds the current batch, its start, its metrics
    and the buffer, for checkpoints. Raises ValueError on reuse < 1, replay < 0 or a fraction outside [0, 1].
    """

    def __init__(self, reuse: int = 1, replay: int = 0, fraction: float = 0.0, batch_size: int = 1,
                 seed: int = 0):
        if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 1:
            raise ValueError(f"reuse must be an integer >= 1, got {reuse!r}")
        if isinstance(replay, bool) or not isinstance(replay, int) or replay < 0:
            raise ValueError(f"replay must be an integer >= 0 (rollout batches), got {replay!r}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"replay fraction must be in [0, 1], got {fraction!r}")
        self.reuse, self.fraction, self.seed = reuse, float(fraction), seed
        self.buffer = ReplayBuffer(replay * max(0, int(batch_size)))
        self.current: list[dict] | None = None
        self.started = 0  # iteration that rolled out `current`
        self.metrics: dict = {}

    def needs_rollout(self, it: int) -> bool:
        """Whether iteration `it` starts with a fresh rollout."""
        return self.current is None or (it - 1) % self.reuse == 0

    def reuse_index(self, it: int, fresh: bool = False) -> int:
        """0 for the iteration that rolls (`fresh`) or rolled the current batch out, then 1, ..., K - 1."""
        return 0 if fresh else it - self.started

    def start(self, it: int, items: list[dict], metrics: dict | None = None) -> None:
        """Iteration `it` rolled out `items` (with the rollout's `metrics`, plain numbers): the
        previous batch goes to the replay buffer."""
        if self.current is not None and self.buffer.capacity > 0:
            self.buffer.add(self.current)
        self.current = [_cpu_copy(x) for x in items]
        self.started = it
        self.metrics = dict(metrics or {})

    def pool(self, fresh: bool = False) -> list[dict]:
        """The replayable items (see `replayed` for `fresh`), oldest first."""
        cap = self.buffer.capacity
        pool = self.buffer.items()
        if fresh and self.current is not None and cap > 0:
            pool = (pool + self.current)[-cap:]
        return pool

    def replayed(self, it: int, batch_size: int, fresh: bool = False) -> list[dict]:
        """The replayed items of iteration `it`: round(fraction x batch_size), fewer while the
        buffer holds fewer (none when it is empty or replay is off). `fresh`: `it` rolled out
        a new batch that `start` has not taken yet; the draw is then from the buffer as
        `start` will leave it (the batch being replaced included, the oldest beyond capacity
        not), so the previous batch is replayable at once, without changing anything yet."""
        pool = self.pool(fresh)
        k = int(round(self.fraction * batch_size))
        if not pool or k == 0:
            return []
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + it * 7919 + 104_723) % 2**63)
        return _draw(pool, k, g)

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current, "started": self.started, "metrics": dict(self.metrics),
                "buffer": self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (a resumed run continues the reuse cycle and the buffer)."""
        if not isinstance(state, dict) or "buffer" not in state:
            raise ValueError("not a RolloutSchedule state_dict (needs current, started, buffer)")
        self.current = None if state.get("current") is None else [_cpu_copy(x) for x in state["current"]]
        self.started = int(state.get("started", 0))
        self.metrics = dict(state.get("metrics") or {})
        self.buffer.load_state_dict(state["buffer"])


def _pad(rows: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-trajectory 1-D tensors -> [B, T] right-padded with zeros (False)."""
    out = torch.zeros(len(rows), max((int(x.numel()) for x in rows), default=0), dtype=dtype)
    for i, x in enumerate(rows):
        out[i, : x.numel()] = x.to(dtype)
    return out


def off_policy_batch(cfg, schedule: Optional[RolloutSchedule], logprobs, it: int, sums: MetricSums, batch: TrainBatch,
                     fresh: bool = False) -> TrainBatch:
    """The batch iteration `it` trains on: `batch` with this iteration's replayed trajectories
    from `schedule` (None: no reuse or replay) appended, and the importance-sampling correction
    of TrainConfig `cfg` (algorithm.is_correction: `is_weights` set; with "mis", trajectories
    left with no token dropped); its figures into `sums` (figures of the whole batch: reuse,
    replay and the correction run in one process only). `fresh`: `batch` was just rolled
    out (`schedule.start` takes it after the iteration's last drop point).

    Replayed trajectories keep their sampler log-probs, advantages and returns; their old
    log-probs (the ratio's anchor), values and reference log-probs are the current models'
    (`logprobs.compute_old`), so the weights pi_old / pi_sampler correct the policy lag
    (decoupled PPO)."""
    a = cfg.algorithm
    rep = schedule.replayed(it, len(batch), fresh) if schedule is not None else []
    if schedule is not None:
        sums.value("rollout/reuse_index", schedule.reuse_index(it, fresh))
        sums.value("replay/size", len(schedule.pool(fresh)))
        sums.value("replay/trajectories", len(rep))
        if rep:
            sums.value("replay/age_mean", float(np.mean([it - x["iteration"] for x in rep])))
    if rep:
        old = TrainBatch.from_rows(rep)
        old.old_logprobs, _, r_vals, r_ref = logprobs.compute_old(old)
        old.values = None if batch.values is None else r_vals
        old.ref_logprobs = None if batch.ref_logprobs is None else r_ref
        old.returns = None if batch.returns is None else old.returns
        # (entropies are the rollout's metric, not trained on)
        batch = TrainBatch.concat([dataclasses.replace(batch, entropies=None), old])
    corr = alg.rollout_correction(_pad(batch.old_logprobs), _pad(batch.sample_logprobs),
                                  _pad(batch.loss_mask, torch.bool), a.is_correction, a.is_level, a.is_cap)
    for k in ("is_ratio_mean", "is_ratio_max", "is_ratio_min", "is_weight_mean", "is_truncated_frac"):
        sums.value(f"actor/{k}", corr.metrics[k])
    sums.value("rollout/mismatch_kl", corr.metrics["mismatch_kl"])
    if a.is_correction == "none":
        return batch
    n = [int(x.numel()) for x in batch.input_ids]
    batch.is_weights = [corr.weights[i, : n[i]] for i in range(len(batch))]
    if a.is_correction == "mis":  # dropped tokens leave the loss (and the loss's normalisation)
        batch.loss_mask = [corr.keep[i, : n[i]] for i in range(len(batch))]
        kept = [i for i in range(len(batch)) if bool(batch.loss_mask[i].any())]
        if len(kept) < len(batch):
            batch = batch.select(kept)
    return batch
