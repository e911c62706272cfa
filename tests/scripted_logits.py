"""A scripted causal LM for rollout tests: a real transformers model whose next-token
logits are replaced by a script, so every stop kind can be produced on purpose.

The next token after a forward is a function of the last token fed on each row:
``table[last]`` is one id (chosen with log-prob 0) or a tuple of ids (drawn uniformly,
log-prob -log(len)). Ids missing from the table go to ``default``. Everything else (the
engine's KV cache, batching, eviction, stop checks) runs for real. The hook also records
what each forward was fed, so tests can compare it with what the engine reports.
"""
from __future__ import annotations

import torch


class ScriptedLogits:
    """Forward hook on `model` (remove with `close()`); `fed` lists, per forward, the
    (position, token) pairs of each row (the engine packs a forward's rows into one; the
    forward's `fastpo_kv` step says where each row's tokens are)."""

    def __init__(self, model, table: dict | None, default: int | None = None):
        """table None: record only, the model's own logits are kept."""
        self.table = None if table is None else dict(table)
        self.default = default
        self.fed: list = []
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def close(self) -> None:
        self._handle.remove()

    def _hook(self, module, args, kwargs, out):
        # the engine packs each forward's rows into one: row i is tokens [offsets[i], offsets[i + 1])
        ids, pos = kwargs["input_ids"][0].tolist(), kwargs["position_ids"][0].tolist()
        offsets = kwargs["fastpo_kv"][1].offsets
        rows = [range(a, b) for a, b in zip(offsets, offsets[1:])]
        self.fed.append([[(int(pos[i]), int(ids[i])) for i in row] for row in rows])
        if self.table is None:
            return out
        logits = out.logits  # [1, rows, V]: each row's last token
        logits.fill_(-1e4)
        for r, row in enumerate(rows):
            nxt = self.table.get(ids[row[-1]], self.default)
            logits[0, r, list(nxt) if isinstance(nxt, tuple) else [nxt]] = 0.0
        return out
