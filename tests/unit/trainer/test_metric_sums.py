"""fastpo/trainer/metric_sums.py: an iteration's figures kept as sums and reduced once. Several
processes are simulated by threads that exchange what torch.distributed would (the module's two
collectives patched), so that a batch split over "ranks" in any way, a rank without data
included, must give the one-process figures of the whole batch."""
import math
import threading

import pytest
import torch

import fastpo.trainer.metric_sums as metric_sums
from fastpo.distributed.context import SINGLE, DistContext, DistributedError
from fastpo.report.metrics import rollout_metrics, rollout_sums
from fastpo.rollout.trajectory_batch import TrajectoryBatch, count_rates
from fastpo.trainer.metric_sums import MetricSums


def reduce_in_threads(monkeypatch, parts: list) -> list:
    """Each MetricSums of `parts` reduced as rank r of len(parts) (one thread each): the
    module's all_gather_object and all_reduce exchange through the threads, in rank order."""
    n = len(parts)
    barrier, slots = threading.Barrier(n), [None] * n

    def exchange(rank, obj):
        barrier.wait()
        slots[rank] = obj
        barrier.wait()
        return list(slots)

    calls = []

    def gather(ctx, obj):
        calls.append("all_gather_object")
        return exchange(ctx.rank, obj)

    def all_reduce(ctx, values, op="sum"):
        assert op == "sum"
        calls.append("all_reduce")
        return [sum(col) for col in zip(*exchange(ctx.rank, values))]

    monkeypatch.setattr(metric_sums, "all_gather_object", gather)
    monkeypatch.setattr(metric_sums, "all_reduce", all_reduce)
    out, errors = [None] * n, []

    def run(r):
        try:
            out[r] = parts[r].reduce(DistContext(rank=r, world_size=n, backend="gloo"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert calls.count("all_gather_object") == n and calls.count("all_reduce") <= n  # two collectives per rank
    return out


def token_figures(chunks: list) -> MetricSums:
    """The figures of micro-batches `chunks` (1-D float tensors of per-token values)."""
    s = MetricSums()
    for x in chunks:
        s.mean("mean", x.double().sum(), x.numel())
        s.std("std", x)
        s.max("max", x.max() if x.numel() else None)
        s.min("min", x.min() if x.numel() else None)
        s.total("tokens", x.numel())
    return s


def test_one_process_figures_of_each_kind():
    s = MetricSums()
    s.mean("m", 3.0, 2)
    s.mean("m", torch.tensor(1.0), 2)
    s.mean("empty", 0.0, 0)
    s.mean("gone", 0.0, 0, optional=True)
    s.std("sd", torch.tensor([1.0, 2.0, 4.0]))
    s.std("one", torch.tensor([5.0]))
    s.total("t", 2)
    s.total("t", 3.5)
    s.max("hi", 1.0)
    s.max("hi", torch.tensor(3.0))
    s.min("lo")
    s.value("int", 4)
    s.value("norm", torch.tensor(2.0))
    s.value("norm", 4.0)
    s.per_rank("trajectories", 6)
    s.per_rank("mib", 1.5)
    out = s.reduce(SINGLE)
    assert out == {"m": 1.0, "empty": 0.0, "sd": pytest.approx(float(torch.tensor([1.0, 2.0, 4.0]).std())),
                   "one": 0.0, "t": 5.5, "hi": 3.0, "lo": 0.0, "int": 4, "norm": 3.0,
                   "dist/rank0/trajectories": 6, "dist/rank0/mib": 1.5}
    assert isinstance(out["int"], int) and isinstance(out["dist/rank0/trajectories"], int)
    assert list(out)[:3] == ["m", "empty", "sd"]  # the order the keys were recorded
    with pytest.raises(ValueError, match="'m' is recorded as max, earlier as mean"):
        s.max("m", 1.0)


def test_merge_adds_replace_takes_the_other_entry_and_a_copy_is_apart():
    a, b = MetricSums(), MetricSums()
    a.mean("m", 1.0, 1)
    a.max("x", 2.0)
    a.value("v", 1.0)
    a.mean("critic/value_mean", 10.0, 1)
    b.mean("m", 3.0, 1)
    b.max("x", 5.0)
    b.value("v", 3.0)
    a.merge(b)
    assert a.reduce(SINGLE) == {"m": 2.0, "x": 5.0, "v": 2.0, "critic/value_mean": 10.0}
    snapshot = a.copy()
    a.mean("m", 100.0, 1)
    assert snapshot.reduce(SINGLE)["m"] == 2.0 and a.reduce(SINGLE)["m"] == 104 / 3
    c = MetricSums()
    c.mean("critic/value_mean", 1.0, 2)
    a.merge(c, replace=True)
    assert a.reduce(SINGLE)["critic/value_mean"] == 0.5


def test_token_weighted_figures_do_not_depend_on_the_split(monkeypatch):
    """Per-token values in micro-batches of unequal sizes: one process with all of them, and
    three ranks holding 1, 3 and 0 of them, log the same mean, std and extremes: those of all
    the tokens; a mean of the micro-batch means (what the update logged before) does not."""
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(k, generator=g) * 3 + 1 for k in (5, 1, 12, 7)]
    allx = torch.cat(chunks).double()
    one = token_figures(chunks).reduce(SINGLE)
    assert one["mean"] == pytest.approx(float(allx.mean()), rel=1e-12)
    assert one["std"] == pytest.approx(float(allx.std()), rel=1e-12)
    assert (one["max"], one["min"], one["tokens"]) == (float(allx.max()), float(allx.min()), 25.0)
    assert abs(one["mean"] - sum(float(x.mean()) for x in chunks) / 4) > 0.1
    ranks = reduce_in_threads(monkeypatch, [token_figures(chunks[:1]), token_figures(chunks[1:]), MetricSums()])
    for out in ranks:
        assert out == pytest.approx(one, rel=1e-12)


def test_a_rank_without_data_records_nothing_and_keys_of_one_rank_are_kept(monkeypatch):
    """A rank need not know the names of figures it has no data for (an empty share of the
    update); an optional mean nobody counted is left out on every rank; a value is logged where
    it was recorded; per-rank figures come from every rank."""
    a, b = MetricSums(), MetricSums()
    a.mean("actor/entropy", 6.0, 3)
    a.mean("train/game/success_rate", 0.0, 0, optional=True)
    a.value("actor/grad_norm", 0.5)
    b.value("actor/grad_norm", 0.5)
    a.per_rank("trajectories", 3)
    b.per_rank("trajectories", 0)
    ra, rb = reduce_in_threads(monkeypatch, [a, b])
    for out in (ra, rb):
        assert out["actor/entropy"] == 2.0 and out["actor/grad_norm"] == 0.5
        assert (out["dist/rank0/trajectories"], out["dist/rank1/trajectories"]) == (3, 0)
        assert "train/game/success_rate" not in out


def test_a_key_of_two_kinds_on_two_ranks_is_refused_on_both(monkeypatch):
    a, b = MetricSums(), MetricSums()
    a.mean("x", 1.0, 1)
    b.max("x", 1.0)
    with pytest.raises(DistributedError, match="'x' is recorded as"):
        reduce_in_threads(monkeypatch, [a, b])


def _batch(g: torch.Generator, groups: list, group_size: int = 3, envs=None) -> TrajectoryBatch:
    """A synthetic rollout of env groups `groups`: trajectories of 1-3 turns, random lengths,
    scores, successes and action counts, the engine's batch metrics as one rollout reports them
    (`count_rates`, plus its token counts, seconds and a figure of its own)."""
    b = len(groups) * group_size
    turns = torch.randint(1, 4, (b,), generator=g)
    masks, ids = [], []
    for t in turns.tolist():
        n = int(torch.randint(4, 9, (1,), generator=g)) * t
        m = torch.rand(n + 3, generator=g) < 0.6
        m[:3] = False
        masks.append(m)
        ids.append(torch.randint(0, 50, (n + 3,), generator=g))
    valid = torch.randint(0, 4, (b,), generator=g)
    executed = torch.minimum(valid, turns * 2)
    batch = TrajectoryBatch(
        input_ids=ids, loss_mask=masks, sample_logprobs=[torch.zeros(len(x)) for x in ids],
        turn_index=[torch.zeros(len(x), dtype=torch.long) for x in ids],
        turn_rewards=torch.zeros(b, 3), format_penalty=torch.zeros(b, 3), num_turns=turns,
        scores=torch.rand(b, generator=g) * 2 - 0.5, success=torch.rand(b, generator=g) < 0.4,
        num_actions=executed, group_ids=torch.tensor(groups).repeat_interleave(group_size),
        seeds=torch.zeros(b, dtype=torch.long), truncated=torch.rand(b, generator=g) < 0.2,
        stop_reason=["max_turns"] * b, responses=[[]] * b, response_texts=[[]] * b, metrics={},
        valid_actions=valid, invalid_actions=torch.randint(0, 3, (b,), generator=g),
        effective_actions=torch.minimum(executed, torch.randint(0, 3, (b,), generator=g)),
        penalised_turns=torch.minimum(turns, torch.randint(0, 3, (b,), generator=g)),
        env_labels=[envs[i % len(envs)] for i in range(b)] if envs else [],
        info={"envs": list(envs)} if envs else {})
    batch.metrics = {**count_rates(batch), "generated_tokens": float(sum(int(m.sum()) for m in masks)),
                     "prefilled_tokens": 100.0, "seconds": float(torch.rand(1, generator=g)) + 1,
                     "peak_kv_bytes": float(torch.randint(1, 1000, (1,), generator=g)), "custom": float(b)}
    return batch


@pytest.mark.parametrize("envs", [None, ("frozenlake", "sokoban")])
def test_rollout_sums_over_ranks_give_the_whole_batchs_rollout_metrics(monkeypatch, envs):
    """`rollout_sums` of two ranks' shares (env groups 0-1 and 2-4), reduced, equal
    `rollout_metrics` of their concatenation (the one-batch reference, float32 means there), the
    engine's rates those of the whole batch's counts: not the ranks' rates weighted by their
    trajectories (what the rollout figures took before, `combine_metrics`)."""
    g = torch.Generator().manual_seed(1)
    parts = [_batch(g, [0, 1], envs=envs), _batch(g, [2, 3, 4], envs=envs)]
    whole = TrajectoryBatch.concat(parts)
    weighted = dict(whole.metrics)  # the parts' engine figures combined as one batch's (combine_metrics)
    whole.metrics.update(count_rates(whole))
    want = rollout_metrics(whole)
    sums = [MetricSums(), MetricSums()]
    for s, p in zip(sums, parts):
        rollout_sums(p, s)
    got = reduce_in_threads(monkeypatch, sums)
    assert got[0] == got[1]
    got = got[0]
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-12), k
    for k in ("valid_action_rate", "effective_action_rate", "response_length"):
        name = "train/response_length_per_turn" if k == "response_length" else f"train/{k}"
        assert got[name] == pytest.approx(count_rates(whole)[k], rel=1e-12)
    assert weighted["valid_action_rate"] != pytest.approx(got["train/valid_action_rate"], rel=1e-6)
    assert weighted["response_length"] != pytest.approx(got["train/response_length_per_turn"], rel=1e-6)
    assert got["train/generated_tokens"] == sum(p.metrics["generated_tokens"] for p in parts)
    assert got["train/seconds"] == max(p.metrics["seconds"] for p in parts)
    if envs:
        assert {"train/frozenlake/share", "train/sokoban/num_turns"} <= set(got)
    assert not math.isnan(got["train/score_std"]) and got["train/score_std"] > 0
