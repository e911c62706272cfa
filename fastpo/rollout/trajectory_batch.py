"""The trajectory batch handed to the trainer (rollout settings: fastpo.config.RolloutConfig)."""
from __future__ import annotations

import dataclasses

import torch



@dataclasses.dataclass
class TrajectoryBatch:
    """B trajectories (B = env groups x group size), token-in-token-out.

    Per-token fields are lists of B unpadded 1D CPU tensors aligned with input_ids
    (entry t is about token t):
        input_ids: int64 [L_i]; loss_mask: bool [L_i], True exactly on sampled model tokens;
        sample_logprobs: float32 [L_i], log-prob (nats) of each sampled token at the sampling
            temperature, 0 where loss_mask is False; turn_index: int64 [L_i], k on the
            response tokens of turn k (0-based), -1 elsewhere.
        sample_entropies: float32 [L_i], entropy (nats) of the full distribution each sampled
            token was drawn from, at the sampling temperature, 0 off the loss mask; an empty
            list when the engine did not record it (SGLang).
        sample_values: float32 [L_i], the engine's readout (the critic's V(s_t)) of the hidden
            state each sampled token came from, 0 off the loss mask; an empty list when no
            readout was set (see NativeEngine.readout).
    Per-trajectory fields:
        turn_rewards: float32 [B, max_turns], env reward + format penalty per turn, 0 after
            the last turn; format_penalty: float32 [B, max_turns], the penalty part;
        num_turns, num_actions (executed), group_ids, seeds: int64 [B];
        scores: float32 [B], sum of turn_rewards; success, truncated: bool [B];
        stop_reason: B str ("env_done", "max_turns", "action_budget", "context");
        responses: B lists (one per turn) of int64 tensors, the sampled ids of each turn;
        response_texts: B lists of decoded responses (for logging and parsing only);
        user_messages: B lists of the user message texts (the first, then one per
            continued turn), so the chat can be re-rendered for checks and logs.
        turn_stop_reasons: B lists (one per turn) of why the engine ended that response:
            "eot" (an end-of-turn token), "stop_string" (e.g. "</answer>"), "length"
            (max_new_tokens) or "context" (the context limit).
        valid_actions, invalid_actions: int64 [B], recognised action names / unrecognised
            answer pieces over all turns (executed or not); effective_actions: int64 [B],
            executed actions that changed the state; penalised_turns: int64 [B], turns that
            got the format penalty. None when the producer did not count them.
        env_labels: B str, the game each trajectory played (its env.mixture label; the env
            name for a single game); an empty list when the producer did not record it.
        final_observations: B str, the game's state after each trajectory's last turn as
            `render()` gives it (the model never sees it: it is what a judge checks the
            outcome against); an empty list when the producer did not record it.
    Bounded context window only (rollout.context_window = K; empty lists otherwise; see
    fastpo/rollout/window.py): context_turns: int64 [L_i], the turn of each token (0: the always
    kept head); visible_from: int64 [L_i], the oldest turn the token attended to when it
    was fed. The trainer rebuilds the sampler's attention from these two.
    metrics: dict of floats for the whole batch (see MultiTurnRollout.generate).
    info: free-form extras (model label, env name).
    """

    input_ids: list
    loss_mask: list
    sample_logprobs: list
    turn_index: list
    turn_rewards: torch.Tensor
    format_penalty: torch.Tensor
    num_turns: torch.Tensor
    scores: torch.Tensor
    success: torch.Tensor
    num_actions: torch.Tensor
    group_ids: torch.Tensor
    seeds: torch.Tensor
    truncated: torch.Tensor
    stop_reason: list
    responses: list
    response_texts: list
    metrics: dict
    user_messages: list = dataclasses.field(default_factory=list)
    tokenizer: object = dataclasses.field(default=None, repr=False)
    info: dict = dataclasses.field(default_factory=dict)
    turn_stop_reasons: list = dataclasses.field(default_factory=list)
    valid_actions: torch.Tensor | None = None
    invalid_actions: torch.Tensor | None = None
    effective_actions: torch.Tensor | None = None
    penalised_turns: torch.Tensor | None = None
    sample_entropies: list = dataclasses.field(default_factory=list)
    sample_values: list = dataclasses.field(default_factory=list)
    context_turns: list = dataclasses.field(default_factory=list)
    visible_from: list = dataclasses.field(default_factory=list)
    env_labels: list = dataclasses.field(default_factory=list)
    final_observations: list = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def group_size(self) -> int:
        """Trajectories per env group (assumes equal groups)."""
        if len(self) == 0:
            return 0
        return len(self) // max(1, len(torch.unique(self.group_ids)))

    def texts(self, skip_special_tokens: bool = False) -> list:
        """The B trajectories decoded to text (logging only; training uses the ids)."""
        if self.tokenizer is None:
            raise ValueError("this TrajectoryBatch has no tokenizer to decode with")
        return [self.tokenizer.decode(ids.tolist(), skip_special_tokens=skip_special_tokens) for ids in self.input_ids]

    def format_valid(self) -> torch.Tensor:
        """float32 [B]: each trajectory's share of its turns whose answer was well formed and
        valid (no format penalty due), from `penalised_turns` (else from a non-zero
        `format_penalty`, which misses every malformed turn when the penalty is 0); a
        trajectory without turns counts as 0 turns of 1."""
        turns = self.num_turns.clamp_min(1).float()
        bad = (self.penalised_turns.float() if self.penalised_turns is not None
               else (self.format_penalty != 0).float().sum(dim=1))
        return 1.0 - bad / turns

    def select(self, indices) -> "TrajectoryBatch":
        """The sub-batch of trajectories `indices` (list / 1D int or bool tensor), in that order.

        Metrics are kept as measured on the full batch. Raises IndexError for out-of-range
        indices.
        """
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            if idx.shape != (len(self),):
                raise IndexError(f"bool mask must have shape [{len(self)}], got {tuple(idx.shape)}")
            idx = torch.nonzero(idx).flatten()
        idx = idx.long().flatten()
        if idx.numel() and (int(idx.min()) < -len(self) or int(idx.max()) >= len(self)):
            raise IndexError(f"trajectory index out of range for a batch of {len(self)}: {idx.tolist()}")
        il = idx.tolist()

        def pick(t):
            return None if t is None else t[idx]

        return TrajectoryBatch(
            input_ids=[self.input_ids[i] for i in il], loss_mask=[self.loss_mask[i] for i in il],
            sample_logprobs=[self.sample_logprobs[i] for i in il], turn_index=[self.turn_index[i] for i in il],
            turn_rewards=self.turn_rewards[idx], format_penalty=self.format_penalty[idx], num_turns=self.num_turns[idx],
            scores=self.scores[idx], success=self.success[idx], num_actions=self.num_actions[idx],
            group_ids=self.group_ids[idx], seeds=self.seeds[idx], truncated=self.truncated[idx],
            stop_reason=[self.stop_reason[i] for i in il], responses=[self.responses[i] for i in il],
            response_texts=[self.response_texts[i] for i in il], metrics=dict(self.metrics),
            user_messages=[self.user_messages[i] for i in il] if self.user_messages else [],
            tokenizer=self.tokenizer, info=dict(self.info),
            turn_stop_reasons=[self.turn_stop_reasons[i] for i in il] if self.turn_stop_reasons else [],
            valid_actions=pick(self.valid_actions), invalid_actions=pick(self.invalid_actions),
            effective_actions=pick(self.effective_actions), penalised_turns=pick(self.penalised_turns),
            sample_entropies=[self.sample_entropies[i] for i in il] if self.sample_entropies else [],
            sample_values=[self.sample_values[i] for i in il] if self.sample_values else [],
            context_turns=[self.context_turns[i] for i in il] if self.context_turns else [],
            visible_from=[self.visible_from[i] for i in il] if self.visible_from else [],
            env_labels=[self.env_labels[i] for i in il] if self.env_labels else [],
            final_observations=[self.final_observations[i] for i in il] if self.final_observations else [],
        )

    @classmethod
    def concat(cls, batches: list) -> "TrajectoryBatch":
        """One batch of `batches`' trajectories in order (e.g. every process's share of an
        iteration, rank order). Per-trajectory fields are concatenated; the tokenizer and
        info come from the first batch; `metrics` are combined by `combine_metrics`; the
        per-turn fields are padded with zeros to the widest batch's turns (the games of a
        mixture may have different turn limits). Raises ValueError for an empty list."""
        if not batches:
            raise ValueError("concat needs at least one TrajectoryBatch")
        if len(batches) == 1:
            return batches[0]
        kw = {}
        for f in dataclasses.fields(cls):
            vals = [getattr(b, f.name) for b in batches]
            if f.name in ("tokenizer", "info"):
                kw[f.name] = vals[0]
            elif f.name == "metrics":
                kw[f.name] = combine_metrics(vals, [len(b) for b in batches])
            elif isinstance(vals[0], torch.Tensor):
                if vals[0].dim() == 2:  # per-turn fields of games with different turn limits: zeros after the last turn
                    width = max(v.shape[1] for v in vals)
                    vals = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in vals]
                kw[f.name] = torch.cat(vals)
            elif vals[0] is None:
                kw[f.name] = None
            else:  # per-trajectory lists; an optional one is empty in every batch or in none
                kw[f.name] = [x for v in vals for x in v]
        return cls(**kw)

    def response_lengths(self) -> torch.Tensor:
        """int64 [B]: model tokens per trajectory (all turns)."""
        return torch.tensor([int(m.sum()) for m in self.loss_mask], dtype=torch.long)


def count_rates(batch: TrajectoryBatch) -> dict:
    """The engine's per-action and per-turn rates of `batch` from its per-trajectory counts, as
    one rollout of all its trajectories would report them (`MultiTurnRollout.generate`'s
    metrics; exact for a concatenation, where `combine_metrics` weights each part's rate by
    its trajectories): valid_action_rate (recognised / all answer pieces), effective_action_rate
    (state-changing / executed actions), response_length (model tokens per turn) and
    num_actions (executed actions per trajectory). {} when the batch holds no counts."""
    if batch.valid_actions is None or batch.invalid_actions is None or batch.effective_actions is None:
        return {}
    valid, invalid = int(batch.valid_actions.sum()), int(batch.invalid_actions.sum())
    executed, turns = int(batch.num_actions.sum()), int(batch.num_turns.sum())
    return {
        "valid_action_rate": valid / max(1, valid + invalid),
        "effective_action_rate": int(batch.effective_actions.sum()) / max(1, executed),
        "response_length": float(sum(int(m.sum()) for m in batch.loss_mask)) / max(1, turns),
        "num_actions": executed / max(1, len(batch)),
    }


#: Batch metrics that add up over batches rolled out side by side (counts of tokens, bytes).
SUMMED_METRICS = ("prefilled_tokens", "generated_tokens")
#: Batch metrics of wall-clock time or peak size: the largest batch's (they ran side by side).
MAX_METRICS = ("seconds", "engine_seconds", "peak_kv_bytes", "peak_kv_token_bytes")


def combine_metrics(metrics: list, sizes: list) -> dict:
    """The `metrics` of batches rolled out side by side (one per process), as one batch's:
    token counts summed, seconds and peak sizes the largest, `tokens_per_s` the summed
    generated tokens over the largest seconds, any other number the mean weighted by the
    batches' trajectory counts `sizes` (a rate over turns or actions is so approximated by
    one over trajectories). Keys missing from a batch are left out of the weights."""
    out: dict = {}
    keys = [k for k in metrics[0]] + [k for m in metrics[1:] for k in m if k not in metrics[0]]
    for k in keys:
        pairs = [(m[k], n) for m, n in zip(metrics, sizes) if isinstance(m.get(k), (int, float))
                 and not isinstance(m.get(k), bool)]
        if not pairs:
            continue
        if k in SUMMED_METRICS:
            out[k] = float(sum(v for v, _ in pairs))
        elif k in MAX_METRICS:
            out[k] = float(max(v for v, _ in pairs))
        else:
            total = sum(n for _, n in pairs)
            out[k] = float(sum(v * n for v, n in pairs) / total) if total else 0.0
    if "tokens_per_s" in out and "generated_tokens" in out and out.get("seconds"):
        out["tokens_per_s"] = out["generated_tokens"] / out["seconds"]
    return out
