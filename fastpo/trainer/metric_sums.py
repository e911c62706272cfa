"""An iteration's metrics kept as local sums and reduced once over the processes (`MetricSums`).

Each part of an iteration records what it measured on this process's share of the batch (a
sum and a count, an extreme, a figure every process already holds); `MetricSums.reduce` turns
all of them into the logged figures at the end of the iteration with two collectives, whatever
the number of metrics: a gather of the recorded key names (a process without data for a figure,
e.g. one the filter left without trajectories, need not know its name) and one all-reduce (sum)
of one packed float64 tensor, where an extreme or a per-process figure takes one slot per
process. One process runs no collective. A figure is thus the whole batch's, the same for any
number of processes: a per-token mean is the sum over all the iteration's tokens divided by
their count, not a mean of per-micro-batch or per-process means.
"""
from __future__ import annotations

import math

import torch

from fastpo.distributed.collectives import all_gather_object, all_reduce
from fastpo.distributed.context import DistContext, DistributedError

#: The kinds of entry, and how many float64 numbers each packs per process (None: one per rank).
_WIDTH = {"mean": 2, "total": 1, "std": 3, "max": None, "min": None, "per_rank": None, "value": 0}
#: The data of a kind's entry that holds nothing (nothing counted, no extreme).
_EMPTY = {"mean": [0.0, 0.0], "total": [0.0], "std": [0.0, 0.0, 0.0], "max": [-math.inf], "min": [math.inf],
          "per_rank": [0.0]}


def _number(x) -> float:
    """A Python float of a number or a 0-dim tensor (float64 for the sums)."""
    return float(x.detach().double()) if isinstance(x, torch.Tensor) else float(x)


class MetricSums:
    """Named metrics as this process's sums, reduced over the processes once (`reduce`).

    Record with (a key is recorded as one kind, on every process that records it):

    - `mean(key, total, count)`: sum of `total` over the calls and processes / sum of `count`
      (0.0 when the counts sum to 0; left out then when `optional`). A per-token figure passes
      (its sum over the tokens, the token count), a per-trajectory one (sum, trajectories).
    - `std(key, x)`: the sample standard deviation (n - 1) of every entry of the tensors `x`
      passed (float64 sums of x and x^2; 0.0 for fewer than 2 entries).
    - `total(key, value)`: the sum over the calls and processes.
    - `max(key, value)`, `min(key, value)`: over the calls and processes; `value=None` records
      nothing (a process without data); 0.0 when no process gave one.
    - `value(key, value)`: a figure every process already holds (a global one: the filter's,
      the gradient norm of a step): not reduced; one call logs `value` as given (an int stays
      an int), several their mean.
    - `per_rank(name, value)`: each process's own, logged as `dist/rank<R>/<name>` (an int
      stays an int).

    Recording a key again with another kind raises ValueError. `reduce(ctx)` returns {key:
    figure} in the order the keys were first recorded here (then any recorded only elsewhere).
    """

    def __init__(self):
        self._kind: dict[str, str] = {}
        self._data: dict[str, list] = {}
        self._optional: set[str] = set()
        self._ints: set[str] = set()

    def _entry(self, key: str, kind: str, init: list) -> list:
        had = self._kind.setdefault(key, kind)
        if had != kind:
            raise ValueError(f"metric {key!r} is recorded as {kind}, earlier as {had}")
        return self._data.setdefault(key, init)

    def mean(self, key: str, total, count, optional: bool = False) -> None:
        d = self._entry(key, "mean", [0.0, 0.0])
        d[0] += _number(total)
        d[1] += _number(count)
        if optional:
            self._optional.add(key)

    def std(self, key: str, x: torch.Tensor) -> None:
        d = self._entry(key, "std", [0.0, 0.0, 0.0])
        x = x.detach().double().reshape(-1)
        d[0] += x.numel()
        d[1] += float(x.sum())
        d[2] += float((x * x).sum())

    def total(self, key: str, value) -> None:
        self._entry(key, "total", [0.0])[0] += _number(value)

    def max(self, key: str, value=None) -> None:
        d = self._entry(key, "max", list(_EMPTY["max"]))
        if value is not None:
            d[0] = max(d[0], _number(value))

    def min(self, key: str, value=None) -> None:
        d = self._entry(key, "min", list(_EMPTY["min"]))
        if value is not None:
            d[0] = min(d[0], _number(value))

    def value(self, key: str, value) -> None:
        d = self._entry(key, "value", [0.0, 0, None])
        d[0] += _number(value)
        d[1] += 1
        d[2] = value if isinstance(value, (int, float)) else _number(value)

    def per_rank(self, name: str, value) -> None:
        self._entry(name, "per_rank", [0.0])[0] = _number(value)
        if isinstance(value, int) and not isinstance(value, bool):
            self._ints.add(name)

    def copy(self) -> "MetricSums":
        """An independent copy of what is recorded so far."""
        out = MetricSums()
        out.merge(self)
        return out

    def merge(self, other: "MetricSums", replace: bool = False) -> None:
        """Add `other`'s entries to these (sums added, extremes compared, a value's calls
        counted); `replace`: a key both hold takes `other`'s entry instead."""
        for key, kind in other._kind.items():
            d = other._data[key]
            if replace and key in self._kind:
                del self._kind[key], self._data[key]
                self._optional.discard(key)
                self._ints.discard(key)
            if key not in self._kind:
                self._kind[key], self._data[key] = kind, list(d)
            elif self._kind[key] != kind:
                raise ValueError(f"metric {key!r} is recorded as {kind}, earlier as {self._kind[key]}")
            elif kind == "max":
                self._data[key][0] = max(self._data[key][0], d[0])
            elif kind == "min":
                self._data[key][0] = min(self._data[key][0], d[0])
            elif kind == "per_rank":
                self._data[key][0] = d[0]
            elif kind == "value":
                mine = self._data[key]
                mine[0], mine[1], mine[2] = mine[0] + d[0], mine[1] + d[1], d[2]
            else:
                self._data[key] = [a + b for a, b in zip(self._data[key], d)]
        self._optional |= other._optional
        self._ints |= other._ints

    def reduce(self, ctx: DistContext) -> dict:
        """The logged figures over every process of `ctx` (see the class); collective with
        several processes (every rank calls it at the same point): one gather of the recorded
        key names, one all-reduce of the packed sums. A key a process did not record (it held
        no data for it, e.g. no micro-batch of the update) counts there as empty: no count, no
        extreme; a `value` is logged where it was recorded. Raises
        fastpo.distributed.context.DistributedError when two processes recorded a key as
        different kinds."""
        world, rank = (ctx.world_size, ctx.rank) if ctx.initialized else (1, 0)
        kinds, optional, ints = self._all_keys(ctx)
        order = sorted(kinds) if ctx.initialized else list(kinds)  # the same packing order on every rank
        packed: list[float] = []
        where: dict[str, int] = {}
        for k in order:
            width = _WIDTH[kinds[k]]
            if width == 0:
                continue
            d = self._data.get(k) or _EMPTY[kinds[k]]
            where[k] = len(packed)
            if width is None:  # one slot per rank, this rank's filled: the sum over ranks is every rank's value
                packed += [d[0] if r == rank else 0.0 for r in range(world)]
            else:
                packed += d
        if ctx.initialized and packed:
            packed = all_reduce(ctx, packed, "sum")
        out: dict = {}
        for k in list(self._kind) + [k for k in order if k not in self._kind]:
            i, kind = where.get(k, 0), kinds[k]
            if kind == "value":
                d = self._data.get(k)
                if d is not None:
                    out[k] = d[2] if d[1] == 1 else d[0] / d[1]
            elif kind == "mean":
                if packed[i + 1] or k not in optional:
                    out[k] = packed[i] / packed[i + 1] if packed[i + 1] else 0.0
            elif kind == "total":
                out[k] = packed[i]
            elif kind == "std":
                n, s1, s2 = packed[i:i + 3]
                mean = s1 / n if n else 0.0
                out[k] = math.sqrt(max(0.0, (s2 - n * mean * mean) / (n - 1))) if n > 1 else 0.0
            elif kind in ("max", "min"):
                vals = [v for v in packed[i:i + world] if v != _EMPTY[kind][0]]  # (a rank that gave none)
                out[k] = (max(vals) if kind == "max" else min(vals)) if vals else 0.0
            else:  # per_rank
                out.update({f"dist/rank{r}/{k}": int(v) if k in ints else v for r, v in enumerate(packed[i:i + world])})
        return out

    def _all_keys(self, ctx: DistContext) -> tuple[dict, set, set]:
        """({key: kind}, optional means, integer per-rank figures) recorded on any process (one
        gather of the names with several)."""
        kinds, optional, ints = dict(self._kind), set(self._optional), set(self._ints)
        if not ctx.initialized:
            return kinds, optional, ints
        for theirs, opt, whole in all_gather_object(ctx, (self._kind, self._optional, self._ints)):
            for k, kind in theirs.items():
                if kinds.setdefault(k, kind) != kind:
                    raise DistributedError(f"metric {k!r} is recorded as {kind} on one rank and as {kinds[k]} on "
                                           f"another; every rank must record it alike")
            optional |= opt
            ints |= whole
        return kinds, optional, ints
