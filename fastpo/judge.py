"""An LLM judge: a reward from a judge model's verdict on each finished trajectory, for games
whose success is hard to verify (issue 36; verl's and TRL's LLM-as-judge rewards).

    fastpo train --env mymod:Story reward.judge_rubric_file=rubric.txt reward.judge_scale=number \\
        reward.judge_min=0 reward.judge_max=10

The rubric is the judge's user message with placeholders filled in per trajectory:
`{answer}` (the trajectory's last response), `{task}` (its first user message, the task),
`{transcript}` (every turn, "User: ..." / "Assistant: ..." lines), `{env}` (the game's
name) and `{final}` (the game's state after the last turn, which the model was not shown:
e.g. whether the boxes ended on their targets); it must hold `{answer}` or `{transcript}`. Other braces are left as they are. The
judge (by default the policy's starting weights, frozen; or any model `reward.judge_model`
names) answers greedily, and its reply is read as a verdict:

- scale "yes_no": the first "yes" or "no" word (any case) -> 1.0 or 0.0;
- scale "number": the first number in the reply; inside [judge_min, judge_max] it becomes
  (x - judge_min) / (judge_max - judge_min) in [0, 1].

A reply with no verdict (or a number outside the range, or a prompt longer than the judge's
context) scores `judge_fallback` and is counted (`train/judge_unparsed_rate`). The score goes
on the trajectory's last turn, with `reward.mode` (add / replace) as a reward function's.

The judge runs on fastpo's native engine (`fastpo.rollout.engine.NativeEngine`) over the whole
rollout in batches of `judge_batch_size`: the prompts of a batch share the chat header and the
rubric's text up to its first placeholder, which the engine prefills once for all of them (as
it shares an env group's prompt), so put the instructions first and the trajectory last.
"""
from __future__ import annotations

import dataclasses
import time

from fastpo.rollout.engine import NativeEngine
from fastpo.rollout.prompts import ChatFormat
from fastpo.rollout.sampling import SamplingParams
from fastpo.rubric import JUDGE_SCALES, check_rubric, parse_verdict, render_rubric, rubric_of


@dataclasses.dataclass
class Verdicts:
    """A judged batch: scores float [n] in [0, 1] (the fallback where unparsed), parsed bool
    [n], replies (the judge's texts), too_long (prompts over the judge's context, unjudged),
    seconds (wall time of the judging)."""

    scores: list
    parsed: list
    replies: list
    too_long: int
    seconds: float


class Judge:
    """A judge model grading trajectories with a rubric (module docstring).

    Args:
        model: a transformers causal LM (frozen here: eval mode, no gradients), e.g. a copy of
            the policy's starting weights. tokenizer: its tokenizer, with a chat template.
        rubric: the rubric text (`check_rubric`). scale: "yes_no" or "number"; lo < hi: the
            number scale's range. fallback: the score of a reply without a verdict.
        max_new_tokens: the reply's length cap. batch_size: prompts per engine batch.
        max_context: prompt + reply tokens at most; a longer prompt is not judged (fallback).
    Raises ValueError for a bad scale, range or size, or a rubric `check_rubric` refuses.
    """

    def __init__(self, model, tokenizer, rubric: str, scale: str = "yes_no", lo: float = 0.0, hi: float = 10.0,
                 fallback: float = 0.0, max_new_tokens: int = 8, batch_size: int = 16, max_context: int = 4096):
        if scale not in JUDGE_SCALES:
            raise ValueError(f"judge scale {scale!r}: choose one of {JUDGE_SCALES}")
        if scale == "number" and not lo < hi:
            raise ValueError(f"judge range [{lo}, {hi}]: the minimum must be below the maximum")
        if max_new_tokens < 1 or batch_size < 1 or max_context <= max_new_tokens:
            raise ValueError(f"judge sizes: max_new_tokens {max_new_tokens} and batch_size {batch_size} must be >= 1, "
                             f"max_context {max_context} above max_new_tokens")
        self.rubric = check_rubric(rubric)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.scale, self.lo, self.hi, self.fallback = scale, float(lo), float(hi), float(fallback)
        self.batch_size = batch_size
        self.engine = NativeEngine(self.model, tokenizer)
        eot = ChatFormat(tokenizer).eot_token_ids
        self.params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(eot),
                                     max_context=max_context)

    def prompt_ids(self, traj) -> list:
        """The judge's prompt token ids for `traj`: the rubric as one user message in the judge's
        chat template, with the generation prompt."""
        msgs = [{"role": "user", "content": render_rubric(self.rubric, traj)}]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def grade(self, trajectories: list) -> Verdicts:
        """Judge each trajectory (greedy replies, batched); `Verdicts` in their order."""
        t0 = time.perf_counter()
        n = len(trajectories)
        scores, parsed, replies = [self.fallback] * n, [False] * n, [""] * n
        prompts = [self.prompt_ids(t) for t in trajectories]
        room = self.params.max_context - self.params.max_new_tokens
        todo = [i for i in range(n) if len(prompts[i]) <= room]
        for k in range(0, len(todo), self.batch_size):
            chunk = todo[k:k + self.batch_size]
            self.engine.start([prompts[i] for i in chunk], group_size=1)
            outs = self.engine.generate(list(range(len(chunk))), None, self.params)
            self.engine.finish()
            for i, out in zip(chunk, outs):
                replies[i] = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                v = parse_verdict(replies[i], self.scale, self.lo, self.hi)
                if v is not None:
                    scores[i], parsed[i] = v, True
        return Verdicts(scores, parsed, replies, n - len(todo), time.perf_counter() - t0)


def judge_from_config(reward_cfg, model, tokenizer) -> Judge:
    """The `Judge` of a run's `reward` section (fastpo.config.schema.RewardConfig) on `model`;
    its context is the model's (config.max_position_embeddings, else 4096 tokens)."""
    r = reward_cfg
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_context = int(getattr(text_cfg, "max_position_embeddings", None) or 4096)
    return Judge(model, tokenizer, rubric_of(r), scale=r.judge_scale, lo=r.judge_min, hi=r.judge_max,
                 fallback=r.judge_fallback, max_new_tokens=r.judge_max_new_tokens, batch_size=r.judge_batch_size,
                 max_context=max(max_context, r.judge_max_new_tokens + 2))
