"""Bounded context windows for long multi-turn episodes (`rollout.context_window: K`).

RAGEN's `limited_multi_turn` mode (its `agent_proxy.context_window_mode` with
`max_context_window: K`) shows the model, at turn j, the system prompt, the task and the last
K turns only: turns j-K+1..j, a turn being one user observation and the response to it. RAGEN
re-renders that window as text every turn and trains one sample per turn (the window, loss on
its last response). fastpo keeps each trajectory's KV cache across turns instead, so:

Design: evict and keep positions.
- Sampler (fastpo/rollout/engine.py `evict`): before turn j's forward, the KV entries of turn
  j-K are masked out of the session's cache (and the turn's tokens not fed yet, such as the
  last sampled token, are skipped). Nothing is re-prefilled and no position id is shifted:
  every token keeps its position in the full trajectory. The KV memory held is the head plus
  K turns, not the whole history.
- What a token saw. A token's keys and values are computed once, when it is fed, and the
  context it attends to is the window of that moment. So token x, fed during turn f(x)'s
  forward, attends to key y <= x iff y is in the always-kept head (turn 0) or
  turn(y) >= f(x) - K + 1. Tokens of kept turns were themselves computed while older turns
  were visible; that information stays in their keys and values, exactly as in the sampler
  (the window bounds what is attended to, not what was ever seen, as in StreamingLLM-style
  eviction). The position ids jump over the evicted turns (RoPE sees the gap), so the
  context differs from RAGEN's re-rendered text; what matters for PPO is that the sampler
  and the trainer compute the same policy over it.
- Trainer. The trajectory stays one sequence with its own position ids (0..T-1), one loss
  mask, one advantage per token: filtering, advantages and loss aggregation are unchanged.
  Only the attention inside the trajectory changes: `window_mask` builds the rule above from
  two per-token labels the rollout records (`TrajectoryBatch.context_turns`,
  `visible_from`; in training, plain fields of the batch record, fastpo.trainer.batch), and packing (`pack_micro_batch(windows=...)`) applies it per packed
  segment (fastpo's "segments" attention: one sdpa call per trajectory with a [S, P+S]
  boolean mask instead of the causal fast path; "mask" attention: in the block mask).
  Padding-free packing, shared prompt prefixes and the fused log-prob / loss kernels (which
  read hidden states) are untouched. flash-attn's varlen path takes no mask and is refused.
- Why not re-prefill the window each turn with fresh positions (RAGEN's text semantics)?
  Every turn would recompute the K kept turns (K x more prefill per turn), and the trainer
  would need one sample per turn (the window again, K x more tokens to train on, and the
  per-trajectory advantage / aggregation code split per turn). The benchmark measures the
  sampler side of that alternative (`MultiTurnRollout.refill_window`; bench --part window).

Turn boundaries (token level). Turn 0 (always kept) is the system message and the first user
message up to its end-of-turn separator; turn 1 starts at the assistant header of the first
prompt. Turn u >= 2 starts at the header of user message u: the template tokens closing
response u-1 (end-of-turn token, separator) belong to turn u-1 (`closing_length`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def window_mask(turn: torch.Tensor, visible_from: torch.Tensor, queries: Optional[slice] = None) -> torch.Tensor:
    """Which keys each query of one trajectory attends to under a context window.

    turn: int64 [T], the turn of each token (0 = always kept). visible_from: int64 [T], the
    oldest turn a token saw when it was fed (f(x) - K + 1). queries: the rows to build
    (default all). Returns bool [Q, T]: key y <= query x and (turn[y] == 0 or
    turn[y] >= visible_from[x]). A query always sees the head, so no row is empty.
    """
    turn = torch.as_tensor(turn, dtype=torch.long)
    vis = torch.as_tensor(visible_from, dtype=torch.long)
    n = turn.numel()
    q = torch.arange(n)[queries] if queries is not None else torch.arange(n)
    causal = torch.arange(n)[None, :] <= q[:, None]
    return causal & ((turn[None, :] == 0) | (turn[None, :] >= vis[q][:, None]))


def closing_length(between: Sequence[int], special_ids, eot_ids) -> int:
    """Leading tokens of a between-turn chunk that close the previous response: those before
    the first special token that is not an end-of-turn token (the next message's header);
    0 when there is none."""
    special, eot = set(special_ids), set(eot_ids)
    for i, t in enumerate(between):
        if t in special and t not in eot:
            return i
    return 0


def head_length(chat, first_user: str, prompt_ids: Sequence[int]) -> int:
    """Tokens of `prompt_ids` (the first prompt) that are always kept: the system and first user
    messages without the assistant header and prime; the whole prompt when the template's
    rendering without the header is not a token prefix of it."""
    tok = chat.tokenizer
    text = tok.apply_chat_template(chat.messages(first_user), tokenize=False, add_generation_prompt=False)
    head = chat.encode_template_text(text)
    if 0 < len(head) < len(prompt_ids) and list(prompt_ids[:len(head)]) == list(head):
        return len(head)
    return len(prompt_ids)
