"""Advantages for StarPO: GAE over model tokens (PPO), group-normalized scores (GRPO, Dr.GRPO),
leave-one-out baselines (RLOO) and REINFORCE++ (batch-normalised returns, or a group baseline).

All per-token tensors are [B, T] (B trajectories, right-padded to T tokens) and aligned with
the trajectory's input ids; `loss_mask` [B, T] bool is True on the tokens the model sampled.
Observation and chat-template tokens (loss mask False) carry no reward, no value and no
advantage: GAE runs over the sequence of model tokens only, as RAGEN's trajectory-level PPO
does (arXiv 2504.20073, Sec. 3.2, Eq. 4-6 with the critic's value on every model token).
"""
from __future__ import annotations

from typing import Optional

import torch


def _check_bt(name: str, x: torch.Tensor, shape: torch.Size) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (same as loss_mask)")


def place_rewards(loss_mask: torch.Tensor, scores: torch.Tensor, mode: str = "last_token",
                  turn_index: Optional[torch.Tensor] = None,
                  turn_rewards: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Token-level rewards [B, T] fp32 from trajectory-level results.

    mode "last_token" (the paper's default): trajectory b's score `scores[b]` on its last
    model token. mode "turn": `turn_rewards[b, k]` on the last model token of turn k
    (tokens with `turn_index == k`), so returns seen from turn k include only later rewards.
    A trajectory without any model token gets no reward (nothing to credit).

    Args: loss_mask [B, T] bool; scores [B] float; turn_index [B, T] int (-1 off responses);
    turn_rewards [B, K] float. Raises ValueError on an unknown mode or missing inputs.
    """
    mask = loss_mask.bool()
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    pos = torch.arange(T, device=mask.device).expand(B, T)
    if mode == "last_token":
        if scores.shape != (B,):
            raise ValueError(f"scores has shape {tuple(scores.shape)}, expected ({B},)")
        last = torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=1).values
        has = last >= 0
        rows = torch.arange(B, device=mask.device)[has]
        out[rows, last[has]] = scores.to(torch.float32)[has]
        return out
    if mode == "turn":
        if turn_index is None or turn_rewards is None:
            raise ValueError("reward mode 'turn' needs turn_index [B, T] and turn_rewards [B, K]")
        _check_bt("turn_index", turn_index, mask.shape)
        if turn_rewards.shape[0] != B:
            raise ValueError(f"turn_rewards has {turn_rewards.shape[0]} rows, expected {B}")
        for k in range(turn_rewards.shape[1]):
            sel = mask & (turn_index == k)
            last = torch.where(sel, pos, torch.full_like(pos, -1)).max(dim=1).values
            has = last >= 0
            rows = torch.arange(B, device=mask.device)[has]
            out[rows, last[has]] += turn_rewards[has, k].to(torch.float32)
        return out
    raise ValueError(f"unknown reward mode {mode!r}; use 'last_token' or 'turn'")


@torch.no_grad()
def apply_kl_penalty(rewards: torch.Tensor, logprob: torch.Tensor, ref_logprob: torch.Tensor,
                     loss_mask: torch.Tensor, coef: float, estimator: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty on the token-level reward, as verl's `apply_kl_penalty` (which RAGEN's PPO
    runs used): r_t - coef * kl_t on every model token, before the advantages.

    kl_t is k1 = logprob_t - ref_logprob_t (verl's "kl") or k3 = exp(d) - d - 1 with
    d = ref_logprob_t - logprob_t (verl's "low_var_kl"; d clamped to [-20, 20]); logprob is
    the policy's (the old log-probs, recomputed before the update), ref_logprob the frozen
    reference model's, both in nats.

    Args: rewards, logprob, ref_logprob [B, T] float; loss_mask [B, T] bool (model tokens);
    coef >= 0. Returns (rewards - coef * kl, kl): [B, T] fp32 each, kl zero off the mask.
    Raises ValueError on a shape mismatch, an unknown estimator or a negative coef.
    """
    mask = loss_mask.bool()
    for name, x in (("rewards", rewards), ("logprob", logprob), ("ref_logprob", ref_logprob)):
        _check_bt(name, x, mask.shape)
    if estimator not in ("k1", "k3"):
        raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1' or 'k3'")
    if not coef >= 0:
        raise ValueError(f"KL coefficient must be >= 0, got {coef}")
    lp, ref = logprob.to(torch.float32), ref_logprob.to(torch.float32)
    if estimator == "k1":
        kl = lp - ref
    else:
        d = (ref - lp).clamp(-20.0, 20.0)
        kl = torch.exp(d) - d - 1.0
    kl = torch.where(mask, kl, torch.zeros_like(kl))
    return rewards.to(torch.float32) - coef * kl, kl


@torch.no_grad()
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
                gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the model tokens of each trajectory.

    With model-token positions t_1 < ... < t_M of a row (loss mask True), and V(t_{M+1}) = 0:
        delta_i = r(t_i) + gamma * V(t_{i+1}) - V(t_i)
        A(t_i)  = delta_i + gamma * lam * A(t_{i+1}),   return(t_i) = A(t_i) + V(t_i)
    Observation tokens between turns are skipped (they are not actions), so with
    gamma = lam = 1 (the paper's setting) A(t_i) = sum of rewards from t_i on - V(t_i).

    Args: rewards, values [B, T] float (any dtype; computed in fp32); loss_mask [B, T] bool.
    Returns (advantages, returns), each [B, T] fp32, zero where loss_mask is False.
    Raises ValueError on shape mismatch or gamma/lam outside [0, 1].
    """
    mask = loss_mask.bool()
    _check_bt("rewards", rewards, mask.shape)
    _check_bt("values", values, mask.shape)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lam={lam} must be in [0, 1]")
    B, T = mask.shape
    counts = mask.sum(dim=1)
    M = int(counts.max().item()) if B else 0
    adv = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    if M == 0:
        return adv, adv.clone()
    # Compress each row's model tokens to the left: [B, M] with a validity mask.
    order = torch.argsort((~mask).to(torch.int32), dim=1, stable=True)[:, :M]
    valid = torch.arange(M, device=mask.device).expand(B, M) < counts[:, None]
    r = torch.gather(rewards.to(torch.float32), 1, order) * valid
    v = torch.gather(values.to(torch.float32), 1, order) * valid
    a = torch.zeros(B, M, dtype=torch.float32, device=mask.device)
    next_v = torch.zeros(B, dtype=torch.float32, device=mask.device)
    next_a = torch.zeros(B, dtype=torch.float32, device=mask.device)
    for i in range(M - 1, -1, -1):
        ok = valid[:, i]
        delta = r[:, i] + gamma * next_v - v[:, i]
        cur = delta + gamma * lam * next_a
        a[:, i] = torch.where(ok, cur, torch.zeros_like(cur))
        next_v = torch.where(ok, v[:, i], next_v)
        next_a = torch.where(ok, cur, next_a)
    adv.scatter_(1, order, a * valid)
    adv = adv * mask
    ret = (adv + values.to(torch.float32)) * mask
    return adv, ret


def compute_bilevel_gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, turn: torch.Tensor,
                        gamma: float = 1.0, lam: float = 1.0,
                        high_level_gamma: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """RAGEN's bi-level GAE (RAGEN head, ragen/trainer/core_algos.py
    `compute_bi_level_gae_advantage_return`): a GAE over turns, then one over each turn's tokens.

    Per trajectory, with the model tokens in order, turn k's last model token e_k (K turns),
    r the token rewards and V the values:
    high level (the agent's MDP, one step a turn, discount gamma_H = `high_level_gamma`):
        delta_k = r(e_k) + gamma_H V(e_{k+1}) - V(e_k)   (V(e_{K+1}) = 0),
        A_k = delta_k + gamma_H lam A_{k+1},   R_k = A_k + V(e_k);
    low level (the token MDP inside turn k, discount `gamma`): the turn ends at e_k with
    reward R_k and nothing after it, so A(e_k) = R_k - V(e_k) = A_k, and for the turn's earlier
    tokens t (t' the next one) A(t) = r(t) + gamma V(t') - V(t) + gamma lam A(t').
    returns = A + V on every model token. A turn's end is found from `turn` (RAGEN's code
    takes the tokens with a non-zero reward as the turns' ends, so there a turn that earned
    exactly 0 runs into the next one; here every turn ends at its last model token).

    Args: rewards, values [B, T] float; loss_mask [B, T] bool; turn [B, T] int (each token's
    turn, any value off the mask); gamma, lam, high_level_gamma in [0, 1]. Returns
    (advantages, returns), [B, T] fp32 each, zero off the mask, not whitened.
    Raises ValueError on shape mismatch or a discount outside [0, 1].
    """
    mask = loss_mask.bool()
    for name, x in (("rewards", rewards), ("values", values), ("turn", turn)):
        _check_bt(name, x, mask.shape)
    if not all(0.0 <= g <= 1.0 for g in (gamma, lam, high_level_gamma)):
        raise ValueError(f"gamma={gamma}, lam={lam} and high_level_gamma={high_level_gamma} must be in [0, 1]")
    adv = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    for b in range(mask.shape[0]):
        pos = torch.nonzero(mask[b]).flatten()
        if not pos.numel():
            continue
        r, v = rewards[b, pos].double().tolist(), values[b, pos].double().tolist()
        tb = turn[b, pos].tolist()
        n = len(pos)
        end = [i == n - 1 or tb[i + 1] != tb[i] for i in range(n)]
        a, next_v, next_a = [0.0] * n, 0.0, 0.0
        for i in range(n - 1, -1, -1):  # high level, over the turns' ends
            if end[i]:
                next_a = r[i] + high_level_gamma * next_v - v[i] + high_level_gamma * lam * next_a
                next_v, a[i] = v[i], next_a
        for i in range(n - 1, -1, -1):  # low level, inside each turn
            if not end[i]:
                a[i] = r[i] + gamma * v[i + 1] - v[i] + gamma * lam * a[i + 1]
        adv[b, pos] = torch.tensor(a, dtype=torch.float32, device=mask.device)
    ret = (adv + values.to(torch.float32)) * mask
    return adv, ret


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  unbiased: bool = False) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the entries where `mask` is True; zero elsewhere.

    Mean and variance are taken over all masked tokens of the batch; the variance is the
    biased one (divided by n), or with `unbiased` the sample variance (n - 1; verl's
    `masked_whiten`, used by REINFORCE++; a single masked token then has variance 0). With
    `shift_mean=False` the mean is added back (scale only). Returns fp32, same shape as x.
    Raises ValueError on shape mismatch.
    """
    m = mask.bool()
    _check_bt("x", x, m.shape)
    n = m.sum()
    if n == 0:
        return torch.zeros_like(x, dtype=torch.float32)
    xf = x.to(torch.float32)
    mean = (xf * m).sum() / n
    var = (((xf - mean) ** 2) * m).sum() / (n - 1 if unbiased and n > 1 else n)
    out = (xf - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-normalized trajectory advantages (GRPO; Dr.GRPO with scale_by_std=False).

    For trajectory b in env group g: A_b = (R_b - mean_g) / (std_g + eps), std_g the
    unbiased (n - 1) standard deviation of the group's scores, as verl/RAGEN compute it.
    The RAGEN paper prints the max in place of the mean; the code and the field use the mean,
    and so does fastpo. Dr.GRPO (arXiv 2503.20783) drops the std division: A_b = R_b - mean_g.
    A group of one trajectory, or one whose scores are all equal, gets advantage 0 (group
    statistics in float64: in float32 eight scores of -0.1 leave a std of ~1e-8, and their
    rounding residue divided by it gave advantages of ~0.007 where there is no signal).

    Args: scores [B] float; group_ids [B] int. Returns [B] fp32.
    Broadcast over model tokens with `adv[:, None] * loss_mask`.
    Raises ValueError on shape mismatch.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    s = scores.to(torch.float64)
    out = torch.zeros_like(s)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        x = s[sel]
        if x.numel() < 2 or bool((x == x[0]).all()):
            continue
        a = x - x.mean()
        if scale_by_std:
            a = a / (x.std(unbiased=True) + eps)
        out[sel] = a
    return out.to(torch.float32)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor):
    """(scores in float64, [(index mask, group scores)] per group); ValueError on shape mismatch."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    s = scores.to(torch.float64)
    return s, [(group_ids == g, s[group_ids == g]) for g in torch.unique(group_ids)]


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out (RLOO; Ahmadian et al. 2024, arXiv 2402.14740; verl's "rloo").

    For trajectory b in env group g of n trajectories, the baseline is the mean score of the
    other n - 1: A_b = R_b - (sum_g R - R_b) / (n - 1) = n / (n - 1) * (R_b - mean_g). No std
    division. A group of one trajectory has no other member to compare with: advantage 0
    (as verl's vectorised RLOO; its loop version keeps the raw score). Group statistics in
    float64 (see `grpo_advantages`).

    Args: scores [B] float; group_ids [B] int. Returns [B] fp32, broadcast over model tokens
    with `adv[:, None] * loss_mask`. Raises ValueError on shape mismatch.
    """
    s, groups = _group_stats(scores, group_ids)
    out = torch.zeros_like(s)
    for sel, x in groups:
        n = x.numel()
        if n < 2:
            continue
        out[sel] = (x * n - x.sum()) / (n - 1)
    return out.to(torch.float32)


def turn_rloo_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor, turn: torch.Tensor,
                         group_ids: torch.Tensor) -> torch.Tensor:
    """Turn-level credit for an env group without a critic: each turn's reward-to-go minus a
    leave-one-out baseline of the same turn index (fastpo's "turn_rloo"; RLOO per turn).

    For trajectory b with turns k = 0 .. K_b - 1 (its turns with model tokens), turn reward
    r_bk (the token rewards of turn k's model tokens, summed: with reward_position=turn the
    turn's reward, with KL on the reward its penalty too) and reward-to-go
    G_bk = sum_{k' >= k} r_bk', every model token of turn k gets
        A_bk = G_bk - mean{G_b'k : b' != b in b's env group, K_b' > k}   (0 when no other reached turn k).
    The baseline depends on the turn index and on the other trajectories only, never on b's
    own later actions, so the policy gradient stays unbiased when the policy decides how many
    turns it takes. Normalising each turn index's rewards by its group and summing (MT-GRPO
    style) subtracts a number of baseline terms set by the trajectory's own stopping turn: an
    action-dependent baseline, biased towards or against taking another turn (verl RFC #7244).
    No std division (as RLOO and Dr.GRPO). Group statistics in float64.

    Args: rewards [B, T] float (token rewards on model tokens); loss_mask [B, T] bool; turn
    [B, T] int (each token's turn); group_ids [B] int. Returns [B, T] fp32, zero off the mask.
    Raises ValueError on shape mismatch.
    """
    mask = loss_mask.bool()
    _check_bt("rewards", rewards, mask.shape)
    _check_bt("turn", turn, mask.shape)
    if group_ids.shape != (mask.shape[0],):
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must be [B] with B = {mask.shape[0]}")
    togo = []  # per trajectory: (its turn ids in order, their rewards-to-go)
    for b in range(mask.shape[0]):
        ids, r = [], []
        for k, x in zip(turn[b][mask[b]].tolist(), rewards[b][mask[b]].double().tolist()):
            if not ids or ids[-1] != k:
                ids.append(k)
                r.append(0.0)
            r[-1] += x
        g = [sum(r[j:]) for j in range(len(r))]
        togo.append((ids, g))
    members: dict = {}
    for b, gid in enumerate(group_ids.tolist()):
        members.setdefault(gid, []).append(b)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for group in members.values():
        depth = max(len(togo[b][1]) for b in group)
        # per turn index: the sum and count of the group's rewards-to-go there
        total = [sum(togo[b][1][j] for b in group if len(togo[b][1]) > j) for j in range(depth)]
        count = [sum(1 for b in group if len(togo[b][1]) > j) for j in range(depth)]
        for b in group:
            ids, g = togo[b]
            for j, k in enumerate(ids):
                base = (total[j] - g[j]) / (count[j] - 1) if count[j] > 1 else 0.0
                out[b][mask[b] & (turn[b] == k)] = float(g[j] - base)
    return out.to(rewards.device)


@torch.no_grad()
def reinforce_pp_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor,
                            gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262; verl's "reinforce_plus_plus"): no critic,
    no group: each model token's discounted return, normalised over the whole batch.

    returns: G(t_i) = r(t_i) + gamma * G(t_{i+1}) over the model tokens t_1 < ... < t_M of a
    trajectory (observation tokens between turns are skipped, as in `compute_gae`; verl,
    single-turn, runs over the response), so with gamma = 1 and the reward on the last token
    every token's return is the trajectory's score. Token rewards [B, T] come from
    `place_rewards` (minus the per-token KL penalty when it is on the reward, as the paper).
    advantages: (G - mean) / sqrt(var + 1e-8), mean and sample variance (n - 1) over every
    model token of the batch (verl's masked_whiten).

    Args: rewards [B, T] float; loss_mask [B, T] bool; gamma in [0, 1]. Returns (advantages,
    returns), each [B, T] fp32, zero off the loss mask. Raises ValueError on shape mismatch
    or gamma outside [0, 1].
    """
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards, dtype=torch.float32), loss_mask, gamma, 1.0)
    return masked_whiten(returns, loss_mask, unbiased=True), returns


@torch.no_grad()
def reinforce_pp_baseline_advantages(scores: torch.Tensor, group_ids: torch.Tensor,
                                     loss_mask: torch.Tensor, whiten=None) -> torch.Tensor:
    """REINFORCE++ with a group baseline (arXiv 2501.03262; verl's "reinforce_plus_plus_baseline").

    Each trajectory's score minus its env group's mean score (a group of one: baseline 0, so
    the score itself, as verl), put on every model token, then normalised over all model
    tokens of the batch: (x - mean) / sqrt(var + 1e-8) with the sample variance (n - 1).
    Token-weighted: a long trajectory's tokens count more in the batch statistics.

    Args: scores [B] float; group_ids [B] int; loss_mask [B, T] bool; whiten: None, or a
    function (x [B, T], mask [B, T]) -> [B, T] that does the unbiased normalisation in its
    place (e.g. over a batch spread over several processes). Returns [B, T] fp32, zero off
    the loss mask. Raises ValueError on shape mismatch.
    """
    s, groups = _group_stats(scores, group_ids)
    mask = loss_mask.bool()
    if mask.shape[0] != s.numel():
        raise ValueError(f"loss_mask has {mask.shape[0]} rows, scores {s.numel()}")
    centred = s.clone()
    for sel, x in groups:
        if x.numel() > 1:
            centred[sel] = x - x.mean()
    per_token = centred.to(torch.float32)[:, None] * mask
    if whiten is not None:
        return whiten(per_token, mask)
    return masked_whiten(per_token, mask, unbiased=True)
