"""A worker run by torchrun in tests/test_distributed.py (not a test module itself).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_worker.py CASE OUTDIR

CASE "checks": each rank takes its env groups of `global_batch()` and writes what
fastpo.distributed computes to OUTDIR/rank<R>.json; "raise": rank 1 raises before a
collective rank 0 waits in; "hang": rank 1 sleeps through it (rank 0's collective times out).
"""
import json
import os
import sys
import time

import torch

GROUPS, GROUP_SIZE = 7, 4  # odd: the two ranks hold 4 and 3 groups
FILTERS = [dict(ratio=0.25), dict(ratio=0.5, mode="bottom"), dict(ratio=0.5, strategy="top_p"),
           dict(ratio=0.6, strategy="top_p", top_p_mode="softmax"), dict(ratio=0.5, strategy="min_p"),
           dict(ratio=0.5, keep_zero_std=False), dict(ratio=1.0, mode="none")]
MINI_BATCHES = [list(range(GROUPS * GROUP_SIZE)), list(range(0, GROUPS * GROUP_SIZE, 3))]


def global_batch():
    """(scores [B], group_ids [B], masks: B bool [T_i]) of a small batch with ties, zero-std
    groups and a trajectory without a scored token."""
    g = torch.Generator().manual_seed(3)
    b = GROUPS * GROUP_SIZE
    scores = torch.randint(0, 3, (b,), generator=g).float() * 0.5
    scores[2 * GROUP_SIZE:3 * GROUP_SIZE] = 1.0  # a zero-std group
    group_ids = torch.arange(GROUPS).repeat_interleave(GROUP_SIZE)
    masks = [torch.rand(int(torch.randint(3, 10, (1,), generator=g)), generator=g) < 0.6 for _ in range(b)]
    masks[5] = torch.tensor([True, False, False])
    return scores, group_ids, masks


def checks(out):
    from fastpo import distributed as fd

    ctx = fd.init_from_env("cpu")
    assert ctx.backend == "gloo" and ctx.world_size == 2, ctx
    scores, group_ids, masks = global_batch()
    groups, seeds = fd.rank_seeds(11, 5, GROUPS, ctx.world_size, ctx.rank)
    mine = [i for i in range(len(masks)) if int(group_ids[i]) in groups]
    res = {"groups": groups, "seeds": seeds, "trajectories": mine, "filters": [], "denominators": {}}
    for kw in FILTERS:
        f = fd.global_filter(ctx, scores[mine], group_ids[mine], **kw)
        res["filters"].append({"indices": [mine[i] for i in f.indices.tolist()], "kept_groups": f.kept_groups,
                               "group_std": {str(k): v for k, v in f.group_std.items()}, "kept_ratio": f.kept_ratio,
                               "std_before": f.std_before, "std_after": f.std_after,
                               "zero_std_groups": f.zero_std_groups})
    local_masks = [masks[i] for i in mine]
    for m, mini in enumerate(MINI_BATCHES):
        local = [j for j, i in enumerate(mine) if i in mini]
        for agg in ("token-mean", "seq-mean-token-mean"):
            res["denominators"][f"{m}:{agg}"] = fd.global_loss_denominator(ctx, agg, local_masks, local)
        res["denominators"][f"{m}:counts"] = list(fd.global_counts(ctx, local_masks, local))

    def write():
        with open(os.path.join(out, "main_writes.txt"), "a") as fh:
            fh.write(f"rank {ctx.rank}\n")
        return f"written by rank {ctx.rank}"

    res["on_main"] = fd.on_main(ctx, write)
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as fh:
        json.dump(res, fh)
    fd.shutdown(ctx)


def failing(out, hang):
    from fastpo import distributed as fd

    ctx = fd.init_from_env("cpu")
    if ctx.rank == 1:
        if hang:
            time.sleep(120)
        raise RuntimeError("rank 1: the env exploded")
    fd.all_reduce(ctx, [1.0])  # waits for rank 1
    fd.shutdown(ctx)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    case, outdir = sys.argv[1], sys.argv[2]
    record(checks if case == "checks" else lambda o: failing(o, case == "hang"))(outdir)
