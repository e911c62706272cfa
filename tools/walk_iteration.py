"""Count what one training iteration walks through: the fastpo files and functions it calls,
the walk a reader follows from `fastpo train` to the optimizer step, and the stack depth there.

    python tools/walk_iteration.py [--list] [--json FILE] [-- EXTRA fastpo train ARGS]

How it counts (the same way before and after a change, so the figures compare):

* It runs `fastpo train --env sokoban --model random:tiny-llama --preset tiny --device cpu
  --iterations 2` in this process (evaluation off, no checkpoint before the end, no plots, no
  progress bar; arguments after `--` are added) under `sys.setprofile`.
* Iteration 1 is found without naming the loop's functions: the loop is the innermost frame
  on the stack at both the first and the second call of the multi-turn rollout's `generate`
  (fastpo/rollout/multiturn.py); one iteration is one period of the calls that frame makes
  (between the calls holding the two rollouts), taken from where iteration 1's period begins
  (its stop check) to its end (its record and checkpoint). "Up to the optimizer step" ends at
  the first call of a `step` in torch.optim (the first AdamW step of iteration 1).
* A function is a distinct (file, qualified name) whose Python frame was entered, in a file of
  the fastpo package (fastpo/, envs_native/); the frames on the stack when the span begins
  (the command, `train`, the loop) count too. Not counted, and said so: the games
  (fastpo/envs/, envs_native/: env internals), the kernels (fastpo/kernels/), generator
  expressions, comprehensions and lambdas (names starting with "<"), and every other
  library's functions (torch, transformers, rich).
* The walk to the optimizer step: the fastpo functions on the stack when the optimizer steps
  (from the command's `main` down) and every counted function each of them calls directly
  in the span (one level: not what those call in turn), i.e. what a reader opens to follow
  the iteration from the command to `optimizer.step()`.
* The stack depth: the fastpo frames on the stack when the optimizer steps, from the
  outermost function named `train` in fastpo/trainer/ down to the caller of `step` (torch's
  wrappers not counted); the frames are printed.

Prints the counts with a breakdown by folder (`--list`: every function); `--json FILE`
writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter

EXCLUDED = ("fastpo/envs/", "envs_native/", "fastpo/kernels/")


class Trace:
    """The profile hook: every fastpo call (its function and the index of its caller's call:
    the nearest fastpo frame above it), a shadow stack of fastpo frames, and the moments the
    counts need."""

    def __init__(self, root: str):
        self.root = root + os.sep
        self.calls: list = []  # (function, index of the caller's call or -1)
        self.stack: list = []  # [(frame, index of its call)]
        self.generate: list = []  # the shadow stack at each rollout `generate`
        self.step_at = None  # index of the first optimizer step
        self.stack_at_step: list = []

    def rel(self, code):
        f = code.co_filename
        if not f.startswith(self.root):
            return None
        rel = f[len(self.root):].replace(os.sep, "/")
        return rel if rel.startswith(("fastpo/", "envs_native/")) else None

    def __call__(self, frame, event, arg):
        if event == "return":
            if self.stack and self.stack[-1][0] is frame:
                self.stack.pop()
            return
        if event != "call" or len(self.generate) > 1:
            return
        code = frame.f_code
        if (self.step_at is None and self.generate and code.co_name == "step"
                and os.sep + os.path.join("torch", "optim") + os.sep in code.co_filename):
            self.step_at = len(self.calls)
            self.stack_at_step = [self.calls[i][0] for _, i in self.stack]
            return
        rel = self.rel(code)
        if rel is None:
            return
        self.calls.append(((rel, code.co_qualname), self.stack[-1][1] if self.stack else -1))
        self.stack.append((frame, len(self.calls) - 1))
        if code.co_name == "generate" and rel == "fastpo/rollout/multiturn.py":
            self.generate.append(list(self.stack))

    def iteration_span(self) -> tuple:
        """(index of iteration 1's first call, index after its last, the frames on the stack at
        its start: the command down to the loop)."""
        first, second = self.generate
        d = 0
        while d < min(len(first), len(second)) and first[d][0] is second[d][0]:
            d += 1
        loop = first[d - 1][1]
        kids = [i for i, (_, parent) in enumerate(self.calls) if parent == loop]  # the loop's own calls
        a, b = kids.index(first[d][1]), kids.index(second[d][1])
        period = [self.calls[i][0] for i in kids[a:b]]
        start = a  # back to where iteration 1's period begins (the calls before its rollout's)
        while start > 0 and a - start < len(period) and self.calls[kids[start - 1]][0] == period[start - a - 1]:
            start -= 1
        return kids[start], kids[start + len(period)], [self.calls[i][0] for _, i in first[:d]]


def counted(funcs) -> set:
    return {(f, q) for f, q in funcs if not f.startswith(EXCLUDED) and not q.split(".")[-1].startswith("<")}


def summary(funcs: set) -> dict:
    kept = counted(funcs)
    by_folder = Counter(os.path.dirname(f) for f, _ in kept)
    return {"files": len({f for f, _ in kept}), "functions": len(kept),
            "by_folder": dict(sorted(by_folder.items())),
            "excluded_functions": len({x for x in funcs if x[0].startswith(EXCLUDED)}),
            "list": sorted(f"{f}:{q}" for f, q in kept)}


def from_train(stack: list) -> list:
    """The frames from the outermost fastpo/trainer `train` down."""
    for i, (f, q) in enumerate(stack):
        if f.startswith("fastpo/trainer/") and q.split(".")[-1] == "train":
            return stack[i:]
    return stack


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="print every function counted")
    p.add_argument("--json", help="write the counts to this file")
    p.add_argument("extra", nargs="*", help="more `fastpo train` arguments (after --)")
    args = p.parse_args(argv)
    import fastpo
    from fastpo.cli import main as fastpo_main

    trace = Trace(os.path.dirname(os.path.dirname(os.path.abspath(fastpo.__file__))))
    cmd = ["train", "--env", "sokoban", "--model", "random:tiny-llama", "--preset", "tiny", "--device", "cpu",
           "--iterations", "2", *args.extra, "trainer.eval_every=0", "trainer.eval_before_training=false",
           "trainer.save_every=0", "trainer.plots=false", "trainer.progress=false"]
    with tempfile.TemporaryDirectory() as tmp:
        sys.setprofile(trace)
        try:
            status = fastpo_main([cmd[0], "--out", os.path.join(tmp, "run"), *cmd[1:]])
        finally:
            sys.setprofile(None)
    if status != 0 or len(trace.generate) < 2 or trace.step_at is None:
        print(f"walk_iteration: the run did not roll out twice and step the optimizer (exit {status})",
              file=sys.stderr)
        return 1
    start, end, outer = trace.iteration_span()
    to_step = set(outer) | {fn for fn, _ in trace.calls[start:trace.step_at]}
    whole = set(outer) | {fn for fn, _ in trace.calls[start:end]}
    spine = set(trace.stack_at_step)
    edges = set(zip(outer, outer[1:])) | {(trace.calls[c][0], fn) for fn, c in trace.calls[start:trace.step_at]
                                          if c >= 0}
    read = counted(spine) | {b for a, b in edges if a in spine and b in counted(to_step)}
    frames = from_train(trace.stack_at_step)
    res = {"command": "fastpo " + " ".join(cmd), "excluded": [*EXCLUDED, "<genexpr>, <listcomp>, <lambda>, ..."],
           "iteration": "calls of {}:{} from {}:{} on".format(*outer[-1], *trace.calls[start][0]),
           "to_optimizer_step": summary(to_step), "whole_iteration": summary(whole),
           "walk_to_step": {"files": len({f for f, _ in read}), "functions": len(read),
                            "list": sorted(f"{f}:{q}" for f, q in read)},
           "stack_depth_train_to_step": len(frames), "stack_at_step": [f"{f}:{q}" for f, q in frames]}
    print(res["command"])
    print(f"iteration 1 = the {res['iteration']} (one period of the loop)")
    for name in ("to_optimizer_step", "whole_iteration"):
        s = res[name]
        print(f"{name}: {s['files']} files, {s['functions']} functions called "
              f"({s['excluded_functions']} more in the games and kernels, not counted)")
        for folder, n in s["by_folder"].items():
            print(f"    {folder or '.'}: {n}")
    w = res["walk_to_step"]
    print(f"walk to the optimizer step (the functions on the stack there, and what each calls directly): "
          f"{w['files']} files, {w['functions']} functions")
    print(f"stack depth from train() to the optimizer step: {len(frames)} fastpo frames")
    for f in res["stack_at_step"]:
        print(f"    {f}")
    if args.list:
        for name, items in (("walk to the optimizer step", w["list"]),
                            ("called up to the optimizer step", res["to_optimizer_step"]["list"]),
                            ("called in the whole iteration", res["whole_iteration"]["list"])):
            print(f"{name}:")
            for f in items:
                print(f"    {f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
