"""A worker run by torchrun in tests/integration/test_distributed.py (not a test module itself).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_worker.py CASE OUTDIR

CASE "checks": each rank takes its env groups of `global_batch()` and writes what
fastpo.distributed computes to OUTDIR/rank<R>.json; "raise": rank 1 raises before a
collective rank 0 waits in; "hang": rank 1 sleeps through it (rank 0's collective times out);
"grads": each rank accumulates the fused policy loss's gradient of its trajectories of
`grad_batch()` on `tiny_model()` with global denominators, all-reduces it and takes one
clipped AdamW step (`data_parallel_step`), saving gradients and parameters to
OUTDIR/grads_rank<R>.pt, then the same with the model sharded by FSDP2 (OUTDIR/fsdp_rank<R>.pt).
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


LOSS_AGGS = ("token-mean", "seq-mean-token-mean")


def tiny_model():
    """A tiny random Llama (2 layers, hidden 32, vocab 256, tied embeddings), fp32, seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float().eval()


def grad_batch(model):
    """3 env groups x 2 trajectories: (group ids [6], per trajectory (ids [T], loss mask [T],
    old log-probs [T] near the model's own, advantages [T])), T from 5 to 12."""
    from fastpo.kernels import causal_lm_logprob_entropy

    g = torch.Generator().manual_seed(5)
    items = []
    for _ in range(6):
        t = int(torch.randint(5, 13, (1,), generator=g))
        ids = torch.randint(0, 256, (1, t), generator=g)
        mask = torch.rand(1, t, generator=g) < 0.7
        mask[:, :2] = False
        with torch.no_grad():
            lp, _ = causal_lm_logprob_entropy(model, ids, temperature=1.0)
        old = lp + 0.2 * torch.randn(1, t, generator=g)
        adv = torch.randn(1, 1, generator=g).expand(1, t).contiguous()
        items.append((ids, mask, old, adv))
    return [0, 0, 1, 1, 2, 2], items


class PolicyLoss(torch.nn.Module):
    """The root module of the update: its forward runs the model's body and the fused policy
    loss (LM head included), so FSDP gathers every parameter in it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask, old, adv, loss_agg, denom):
        from fastpo.kernels import causal_lm_policy_loss

        return causal_lm_policy_loss(self.model, ids, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                     entropy_coef=0.001, loss_agg=loss_agg, denominator=denom, impl="chunked").loss


def data_parallel_step(ctx, model, items, mine, loss_agg, fsdp=False, save_to=None):
    """Gradient of trajectories `mine` (accumulated one per micro-batch, divided by the global
    denominator) summed over ranks: all-reduced (replicated parameters) or, fsdp=True,
    reduce-scattered by FSDP2; returns ({name: full grad}, {name: full param after one
    clipped AdamW step})."""
    from fastpo.distributed.data_parallel import global_loss_denominator, micro_batch_count
    from fastpo.distributed.sharding import all_reduce_gradients, full_state_dict, save_hf_model, shard_for_data_parallel

    masks = [m[0] for _, m, _, _ in items]
    denom = global_loss_denominator(ctx, loss_agg, masks, mine)
    root = PolicyLoss(model)
    if fsdp:
        shard_for_data_parallel(ctx, root, model.model.layers)
        assert not ctx.initialized or all(hasattr(p, "full_tensor") for p in model.parameters()), "not sharded"
    model.zero_grad(set_to_none=True)
    for k in range(micro_batch_count(ctx, len(mine)) if fsdp else len(mine)):
        ids, mask, old, adv = items[mine[min(k, len(mine) - 1)]]
        if k >= len(mine):
            mask = torch.zeros_like(mask)  # an empty micro-batch (see micro_batch_count)
        root(ids, mask, old, adv, loss_agg, denom).backward()
    if not fsdp:
        all_reduce_gradients(ctx, model.parameters())
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    state = full_state_dict(ctx, model)  # rank 0's checkpoint view
    assert ctx.rank != 0 or all(torch.equal(state[n], params[n]) for n in params), "full state dict"
    assert ctx.rank == 0 or state == {}
    if save_to is not None:
        assert save_hf_model(ctx, model, save_to) == save_to
    return grads, params


def grads(out):
    from fastpo.distributed.context import init_from_env, shutdown
    from fastpo.distributed.data_parallel import split_groups

    ctx = init_from_env("cpu")
    group_ids, items = grad_batch(tiny_model())
    groups = split_groups(3, ctx.world_size, ctx.rank)
    mine = [i for i, gid in enumerate(group_ids) if gid in groups]
    for name, fsdp in (("grads", False), ("fsdp", True)):
        res = {agg: data_parallel_step(ctx, tiny_model(), items, mine, agg, fsdp,
                                       save_to=os.path.join(out, f"{name}-model-{agg}")) for agg in LOSS_AGGS}
        torch.save({"trajectories": mine, "res": res}, os.path.join(out, f"{name}_rank{ctx.rank}.pt"))
    torch.save(gathered_check(ctx), os.path.join(out, f"gathered_rank{ctx.rank}.pt"))
    shutdown(ctx)


def gathered_check(ctx) -> dict:
    """The trainer's FSDP2 setup (`shard_trainer_modules`) on the tiny model: which parameters
    are DTensor shards outside and inside `gathered`, the LM-head weight the fused kernels
    get inside it, and logits and greedy tokens computed by rank 0 alone inside it (no
    collective: rank 1 waits at the barrier), vs the unsharded model's."""
    import fastpo.trainer.fsdp as ffsdp
    from fastpo.kernels.hf import lm_head_weight
    from torch.distributed.tensor import DTensor

    model = tiny_model()
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    root = ffsdp.shard_trainer_modules(ctx, model)
    res = {"sharded_before": all(isinstance(p, DTensor) for p in model.parameters())}
    with ffsdp.gathered(root):
        w = lm_head_weight(model)
        res["lm_head"] = (type(w).__name__, tuple(w.shape))
        res["whole_inside"] = not any(isinstance(p, DTensor) for p in model.parameters())
        if ctx.rank == 0:
            with torch.no_grad():
                res["logits"] = model(ids).logits
                # (transformers' generate would wait for the other ranks when it sees FSDP;
                # fastpo's NativeEngine runs its own decode loop of plain forwards, as here)
                res["tokens"] = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                               synced_gpus=False)
    torch.distributed.barrier()
    res["sharded_after"] = all(isinstance(p, DTensor) for p in model.parameters())
    return res


def checks(out):
    from fastpo.distributed.collectives import on_main, per_rank
    from fastpo.trainer.metric_sums import MetricSums
    from fastpo.distributed.context import DistributedError, init_from_env, shutdown
    from fastpo.distributed.data_parallel import global_counts, global_filter, global_loss_denominator, rank_seeds

    ctx = init_from_env("cpu")
    assert ctx.backend == "gloo" and ctx.world_size == 2, ctx
    scores, group_ids, masks = global_batch()
    groups, seeds = rank_seeds(11, 5, GROUPS, ctx.world_size, ctx.rank)
    mine = [i for i in range(len(masks)) if int(group_ids[i]) in groups]
    res = {"groups": groups, "seeds": seeds, "trajectories": mine, "filters": [], "denominators": {}}
    for kw in FILTERS:
        f = global_filter(ctx, scores[mine], group_ids[mine], **kw)
        res["filters"].append({"indices": [mine[i] for i in f.indices.tolist()], "kept_groups": f.kept_groups,
                               "group_std": {str(k): v for k, v in f.group_std.items()}, "kept_ratio": f.kept_ratio,
                               "std_before": f.std_before, "std_after": f.std_after,
                               "zero_std_groups": f.zero_std_groups})
    local_masks = [masks[i] for i in mine]
    for m, mini in enumerate(MINI_BATCHES):
        local = [j for j, i in enumerate(mine) if i in mini]
        for agg in ("token-mean", "seq-mean-token-mean"):
            res["denominators"][f"{m}:{agg}"] = global_loss_denominator(ctx, agg, local_masks, local)
        res["denominators"][f"{m}:counts"] = list(global_counts(ctx, local_masks, local))

    def write():
        with open(os.path.join(out, "main_writes.txt"), "a") as fh:
            fh.write(f"rank {ctx.rank}\n")
        return f"written by rank {ctx.rank}"

    res["on_main"] = on_main(ctx, write)
    res["metric_sums"] = metric_sums(ctx, MetricSums, [scores[i] for i in mine], [masks[i] for i in mine])
    odd = MetricSums()  # a key recorded as another kind on each rank: refused on every rank
    (odd.mean if ctx.rank == 0 else odd.max)("x", 1.0, *([1] if ctx.rank == 0 else []))
    try:
        odd.reduce(ctx)
    except DistributedError as e:
        res["kind_mismatch"] = str(e)
    res["per_rank"] = per_rank(ctx, 100 + ctx.rank)
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as fh:
        json.dump(res, fh)
    shutdown(ctx)


def metric_sums(ctx, sums_class, scores, masks) -> dict:
    """`sums_class` (MetricSums) of this rank's share: every kind, a key only rank 0 records
    (a rank without data for it), an optional mean no rank counts; reduced over the ranks."""
    s = sums_class()
    s.mean("score_mean", sum(float(x) for x in scores), len(scores))
    s.std("score_std", torch.stack(scores) if scores else torch.zeros(0))
    tokens = torch.cat([m.float() for m in masks])
    s.mean("mask_rate", tokens.sum(), tokens.numel())
    s.total("tokens", tokens.numel())
    s.max("score_max", max(float(x) for x in scores))
    s.min("score_min", min(float(x) for x in scores))
    s.value("same", 7)
    s.per_rank("trajectories", len(scores))
    if ctx.rank == 0:
        s.mean("only_rank0", 3.0, 2)
        s.max("only_rank0_max", 5.0)
    s.mean("nothing", 0.0, 0, optional=True)
    return s.reduce(ctx)


def failing(out, hang):
    from fastpo.distributed.collectives import all_reduce
    from fastpo.distributed.context import init_from_env, shutdown

    ctx = init_from_env("cpu")
    if ctx.rank == 1:
        if hang:
            time.sleep(120)
        raise RuntimeError("rank 1: the env exploded")
    all_reduce(ctx, [1.0])  # waits for rank 1
    shutdown(ctx)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    case, outdir = sys.argv[1], sys.argv[2]
    cases = {"checks": checks, "grads": grads}
    record(cases.get(case) or (lambda o: failing(o, case == "hang")))(outdir)
    from fastpo.distributed.context import end_process, left_job

    if left_job():  # as fastpo's command line does: no interpreter teardown after FSDP2 (end_process)
        end_process(0)
