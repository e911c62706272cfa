"""Where a decode step of the native engine goes: seconds per step and the operators' shares.

    python bench/profile_decode.py [--rows 5] [--context 430] [--steps 24] [--profile] [--model NAME]

Opens `--rows` sessions of `--context` random prompt tokens on `fastpo.rollout.engine.NativeEngine`,
decodes `--steps` tokens per row (no stop token or string, temperature 1, fixed seed) and
prints the engine's seconds per decode step (`stats["decode_seconds"] / stats["decode_steps"]`:
the one-token forward, sampling and stop checks), median of 3 after one untimed run. With
`--profile`, one more decode under `torch.profiler` and its operators by self CPU time (the
profiler's own overhead included, so shares, not seconds, are what to read). The defaults are
the CPU preset's decode shapes in `bench/throughput.py --part e2e` (5 to 8 live rows at a context
of about 440). Threads: `OMP_NUM_THREADS`.
"""
from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--context", type=int, default=430)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--model", default=None, help="model name (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--profile", action="store_true", help="also print the operators of one decode")
    args = ap.parse_args()
    for k in ("rows", "context", "steps"):
        if getattr(args, k) < 1:
            ap.error(f"--{k} must be >= 1, got {getattr(args, k)}")

    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout.engine import NativeEngine
    from fastpo.rollout.sampling import SamplingParams

    model, tok, *_ = load_model_and_tokenizer(args.model) if args.model else load_model_and_tokenizer()
    engine = NativeEngine(model, tok)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, min(40000, engine.vocab_size), (args.context,), generator=g).tolist()
               for _ in range(args.rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.steps, max_context=args.context + args.steps + 1)
    sessions = list(range(args.rows))

    def decode() -> float:
        engine.start(prompts, 1)
        engine.reset_stats()
        engine.generate(sessions, None, params, torch.Generator().manual_seed(1))
        return engine.stats["decode_seconds"] / engine.stats["decode_steps"]

    decode()
    times = [decode() for _ in range(3)]
    print(f"{args.rows} rows, context {args.context}, {torch.get_num_threads()} threads: "
          f"{statistics.median(times):.4f} s per decode step (median of 3: "
          + ", ".join(f"{t:.4f}" for t in times) + ")")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        engine.start(prompts, 1)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            engine.generate(sessions, None, params, torch.Generator().manual_seed(1))
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
