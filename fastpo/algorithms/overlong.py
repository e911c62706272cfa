"""DAPO's treatment of responses cut at the length limit (arXiv 2503.14476, Sec. 3.4): a soft
penalty on responses that run into the last `buffer` tokens before the limit (overlong reward
shaping), and truncated responses taken out of the loss (overlong filtering). In a multi-turn
trajectory each turn's response is one response: its length is measured against
`rollout.max_new_tokens`, and only a turn that hit that limit leaves the loss.
"""
from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13) per response, a reward to add (<= 0):

        0                                   for |y| <= L_max - L_cache,
        -factor * (|y| - (L_max - L_cache)) / L_cache   inside the last L_cache tokens,
        -factor                             for |y| >= L_max,

    with L_max = `max_len`, L_cache = `buffer` (0 < buffer <= max_len). lengths: int [...]
    response lengths in tokens. Returns float32 of lengths' shape. Raises ValueError for a
    buffer outside (0, max_len] or a negative factor.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    if not factor >= 0:
        raise ValueError(f"overlong penalty factor must be >= 0, got {factor}")
    over = (lengths.to(torch.float32) - (max_len - buffer)).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


def truncated_turn_mask(loss_mask: torch.Tensor, turn_index: torch.Tensor, turn_stop_reasons: list) -> torch.Tensor:
    """Overlong filtering for one trajectory: `loss_mask` [L] with the tokens of every turn that
    stopped at the length limit (stop reason "length") set to 0 (False), the other turns kept.
    turn_index [L] int (the token's turn, -1 off the responses); turn_stop_reasons: one str per
    turn. Returns a tensor of loss_mask's dtype."""
    cut = [t for t, why in enumerate(turn_stop_reasons) if why == "length"]
    if not cut:
        return loss_mask
    drop = torch.isin(turn_index, torch.tensor(cut, dtype=turn_index.dtype))
    return torch.where(drop, torch.zeros_like(loss_mask), loss_mask)
