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
    """Forward hook on `model` (remove with `close()`); `fed` lists, per forward, the real
    (position, token) pairs of each row: attention-masked padding is dropped."""

    def __init__(self, model, table: dict | None, default: int | None = None):
        """table None: record only, the model's own logits are kept."""
        self.table = None if table is None else dict(table)
        self.default = default
        self.fed: list = []
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def close(self) -> None:
        self._handle.remove()

    def _hook(self, module, args, kwargs, out):
        ids = kwargs["input_ids"]
        n = ids.shape[1]
        real = kwargs["attention_mask"][:, -n:].bool()
        pos = kwargs["position_ids"]
        self.fed.append([[(int(p), int(t)) for p, t, m in zip(pos[r].tolist(), ids[r].tolist(), real[r].tolist()) if m]
                         for r in range(ids.shape[0])])
        if self.table is None:
            return out
        logits = out.logits
        logits.fill_(-1e4)
        for r, last in enumerate(ids[:, -1].tolist()):
            nxt = self.table.get(last, self.default)
            logits[r, -1, list(nxt) if isinstance(nxt, tuple) else [nxt]] = 0.0
        return out
