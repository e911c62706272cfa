"""The cost of a plain-Python environment inside a rollout (issue 26).

    python bench/throughput.py --part pyenv [--quick] [--model NAME] [--device cpu|cuda]

A real rollout (`MultiTurnRollout` with the native engine and `--model`) of the example game
`examples.guess_number:GuessNumber` (free text, higher/lower feedback), with every call into
the batched Python env (reset, instructions, action names, step, render) timed. The figure is
the env's seconds beside the whole rollout's seconds, as a ratio rollout / env: the issue's
target is an env share under 5% (ratio >= 20) for B = 16 instances at the CPU preset's size
(4 groups x 4, 5 turns, 16 new tokens, answer-only) and B = 128 at the paper's 8 x 16 (on the
CPU with the CPU preset's 16 new tokens per turn: fewer tokens than the paper's 400 make the
env's share larger, so the CPU figure is the harder one; on a GPU 128 tokens). The game's
`step` is a few microseconds, so what this measures is fastpo's per-instance wrapper
(random-state swap, type checks) against generation.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record  # noqa: E402

PART = "pyenv"
ENV = "examples.guess_number:GuessNumber"
_TIMED = ("reset", "instructions", "action_names", "parse_actions", "step", "step_text", "render")


class _Timed:
    """A batched env whose protocol calls add their wall time to `seconds`."""

    def __init__(self, env):
        self._env = env
        self.seconds = 0.0
        self.answers = 0  # answers that reached the game's step()

    def __getattr__(self, name):
        value = getattr(self._env, name)
        if name not in _TIMED:
            return value

        def timed(*a, **k):
            if name == "step_text":
                self.answers += sum(x is not None for x in a[0])
            t0 = time.perf_counter()
            try:
                return value(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def sizes(ctx: BenchContext) -> list:
    """(label, groups, group size, turns, new tokens) per figure."""
    if ctx.quick:
        return [("B=4 (2x2, quick)", 2, 2, 2, 4)]
    paper_tokens = 128 if ctx.device.startswith("cuda") else 16
    return [("B=16 (4x4, CPU preset)", 4, 4, 5, 16), (f"B=128 (8x16, paper), {paper_tokens} new tokens", 8, 16, 5,
                                                       paper_tokens)]


def run(ctx: BenchContext) -> list:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # examples/ lives at the repository root
        sys.path.insert(0, root)
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, NativeEngine, RolloutConfig

    model, tok, info = load_model_and_tokenizer(ctx.model, device=ctx.device)
    records = []
    for label, P, N, turns, new_tokens in sizes(ctx):
        cfg = RolloutConfig(max_turns=turns, max_actions_per_turn=1, max_actions_per_traj=turns,
                            max_new_tokens=new_tokens, max_context=2048, think=False, prompt_examples=True,
                            temperature=0.7)
        ro = MultiTurnRollout(NativeEngine(model, tok), tok, ENV, {"high": 16}, cfg)
        made = []
        plain = ro.make_env
        ro.make_env = lambda B, member=None: made.append(_Timed(plain(B, member))) or made[-1]
        seeds = [ctx.seed + 17 * g for g in range(P)]
        ro.generate(seeds[:1], 1, seed=ctx.seed)  # warm-up (allocator, first calls)
        env_s, total_s, turns_done, answers = [], [], [], []
        for r in range(max(1, ctx.repeats if ctx.repeats_given else 1)):
            made.clear()
            t0 = time.perf_counter()
            batch = ro.generate(seeds, N, seed=ctx.seed + r)
            total_s.append(time.perf_counter() - t0)
            env_s.append(made[-1].seconds)
            answers.append(made[-1].answers)
            turns_done.append(float(batch.num_turns.float().mean()))
        env_t, total = sorted(env_s)[len(env_s) // 2], sorted(total_s)[len(total_s) // 2]
        records.append(Record(
            PART, f"{ENV} env calls vs the whole rollout, {label}", "s", env_t, total, False,
            baseline_name="the whole rollout (generation + env)", target=20.0,
            notes=f"env share {100 * env_t / total:.2f}% of the rollout; {turns_done[-1]:.1f} turns per trajectory, "
                  f"{answers[-1]} answers stepped by the game; "
                  f"model {info.label}; median of {len(env_s)}; target: share < 5% (ratio >= 20)"))
        records.append(_every_answer_stepped(ro, P * N, turns, total / max(1.0, turns_done[-1]), label, info.label))
    return records


def _every_answer_stepped(ro, B: int, turns: int, rollout_turn_s: float, label: str, model: str) -> Record:
    """The env's cost when all B trajectories answer every turn (a model that rarely answers
    steps the game less): reset, then `turns` x (step_text of B answers + render), per turn,
    beside the measured rollout's seconds per turn."""
    env = ro.make_env(B)
    t0 = time.perf_counter()
    env.reset(list(range(B)))
    env.instructions()
    for t in range(turns):
        env.step_text([str(1 + (3 * t + b) % 16) for b in range(B)])
        env.render()
    per_turn = (time.perf_counter() - t0) / turns
    return Record(PART, f"{ENV} env turn with all {B} answers stepped vs a rollout turn, {label}", "s/turn", per_turn,
                  rollout_turn_s, False, baseline_name="a rollout turn (measured above)", target=20.0,
                  notes=f"env share {100 * per_turn / rollout_turn_s:.2f}% of a turn; reset + {turns} turns of "
                        f"step_text(B answers) + render, divided by {turns}; model {model}")
