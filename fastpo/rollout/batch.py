"""Rollout configuration and the trajectory batch handed to the trainer."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class RolloutConfig:
    """Multi-turn rollout settings (defaults: the paper / RAGEN's).

    max_turns: turns per trajectory (5). max_actions_per_turn: actions read from one answer
    (5; extra ones are ignored, not penalised). max_actions_per_traj: action budget of a
    trajectory (10); it ends when spent. max_new_tokens: response tokens per turn (400).
    max_context: tokens per trajectory (3600); a trajectory that would pass it ends
    truncated. temperature / top_p / top_k: sampling (temperature scales the logits; the
    recorded log-probs are at this temperature). think: prime with "<think>" (True) or the
    answer-only variant primed with "<answer>". format_penalty: added to a turn's reward
    when its answer is missing, malformed or holds an invalid action (-0.1).
    run_valid_actions_on_format_error: in such a turn, still execute the answer's valid
    actions (True, as RAGEN does); False executes nothing. stop_at_answer_close: end a
    response at "</answer>" (the template's end-of-turn token is then appended, loss mask
    0). system_prompt: None for prompts.SYSTEM_PROMPT. feedback_invalid: tell the model
    which actions were invalid in the next user message.
    """

    max_turns: int = 5
    max_actions_per_turn: int = 5
    max_actions_per_traj: int = 10
    max_new_tokens: int = 400
    max_context: int = 3600
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    think: bool = True
    format_penalty: float = -0.1
    run_valid_actions_on_format_error: bool = True
    stop_at_answer_close: bool = True
    system_prompt: str | None = None
    feedback_invalid: bool = True

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_actions_per_turn", "max_actions_per_traj", "max_new_tokens", "max_context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RolloutConfig.{name} must be a positive integer, got {v!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"RolloutConfig.temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"RolloutConfig.top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.format_penalty, (int, float)):
            raise ValueError(f"RolloutConfig.format_penalty must be a number, got {self.format_penalty!r}")


@dataclasses.dataclass
class TrajectoryBatch:
    """B trajectories (B = env groups x group size), token-in-token-out.

    Per-token fields are lists of B unpadded 1D CPU tensors aligned with input_ids
    (entry t is about token t):
        input_ids: int64 [L_i]; loss_mask: bool [L_i], True exactly on sampled model tokens;
        sample_logprobs: float32 [L_i], log-prob (nats) of each sampled token at the sampling
            temperature, 0 where loss_mask is False; turn_index: int64 [L_i], k on the
            response tokens of turn k (0-based), -1 elsewhere.
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
        )

    def response_lengths(self) -> torch.Tensor:
        """int64 [B]: model tokens per trajectory (all turns)."""
        return torch.tensor([int(m.sum()) for m in self.loss_mask], dtype=torch.long)
