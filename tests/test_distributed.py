"""fastpo.distributed (issue 14, first phase) and the CLI's --nproc / torchrun handling.

The 2-process checks run tests/dist_worker.py under torchrun with the gloo backend on the
CPU (a few seconds each) and compare every rank's result with the one-process computation
on the concatenated batch.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fastpo import distributed as fd
from fastpo.algorithms.filtering import filter_groups
from fastpo.cli import main
from fastpo.seeds import iteration_seeds
from run_helpers import ModelLoadReached

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import dist_worker  # noqa: E402


def _torchrun(args, tmp_path, timeout=120, nproc=2, env=None):
    """(exit status, output, seconds) of `torchrun --standalone --nproc_per_node nproc ARGS`."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        e.pop(k, None)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


# --- one process: the helpers are today's computation ------------------------------------

def test_split_groups_keeps_groups_whole_and_balanced():
    for n in range(1, 12):
        for w in range(1, n + 1):
            parts = [fd.split_groups(n, w, r) for r in range(w)]
            assert [g for p in parts for g in p] == list(range(n))  # every group once, in order
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(fd.DistributedError, match="env_groups=2 is below the number of processes \\(3\\)"):
        fd.split_groups(2, 3, 0)
    with pytest.raises(fd.DistributedError, match="rank 2"):
        fd.split_groups(4, 2, 2)


def test_group_seeds_do_not_depend_on_the_world_size():
    full = iteration_seeds(7, 3, 9)
    for w in range(1, 10):
        got = {}
        for r in range(w):
            groups, seeds = fd.rank_seeds(7, 3, 9, w, r)
            got.update(zip(groups, seeds))
        assert [got[g] for g in range(9)] == full


def test_torchrun_variables_are_checked():
    assert fd.torchrun_env({}) is None
    assert fd.torchrun_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(fd.DistributedError, match="RANK is not set"):
        fd.torchrun_env({"WORLD_SIZE": "2"})
    with pytest.raises(fd.DistributedError, match="RANK=2 is outside"):
        fd.torchrun_env({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})
    with pytest.raises(fd.DistributedError, match="WORLD_SIZE='two'"):
        fd.torchrun_env({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"})
    assert fd.timeout_seconds({}) == fd.DEFAULT_TIMEOUT_S
    assert fd.timeout_seconds({fd.TIMEOUT_ENV: "2.5"}) == 2.5
    with pytest.raises(fd.DistributedError, match="FASTPO_DIST_TIMEOUT_S='0'"):
        fd.timeout_seconds({fd.TIMEOUT_ENV: "0"})


def test_one_process_is_todays_path(monkeypatch):
    """Without torchrun nothing initialises torch.distributed and every helper is the
    one-process computation (the same FilterResult, the trainer's loss denominator)."""
    from fastpo.trainer import loss_denominator

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = fd.init_from_env("cpu")
    assert ctx is fd.SINGLE and not torch.distributed.is_initialized()
    scores, group_ids, masks = dist_worker.global_batch()
    for kw in dist_worker.FILTERS:
        a, b = fd.global_filter(ctx, scores, group_ids, **kw), filter_groups(scores, group_ids, **kw)
        assert a.indices.tolist() == b.indices.tolist() and a.kept_groups == b.kept_groups
        assert (a.group_std, a.kept_ratio, a.std_before, a.std_after) == (b.group_std, b.kept_ratio, b.std_before,
                                                                         b.std_after)
    for mini in dist_worker.MINI_BATCHES:
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            assert fd.global_loss_denominator(ctx, agg, masks, mini) == loss_denominator(agg, masks, mini)
    assert fd.on_main(ctx, lambda x: x + 1, 1) == 2
    assert fd.weighted_means(ctx, {"b": 2, "a": 1}, 5) == {"a": 1.0, "b": 2.0}
    assert fd.per_rank(ctx, 3) == [3.0]


# --- two processes (torchrun, gloo) -------------------------------------------------------

def test_two_processes_match_one_process_on_the_global_batch(tmp_path):
    from fastpo.trainer import loss_denominator

    rc, out, _ = _torchrun(["tests/dist_worker.py", "checks", str(tmp_path)], tmp_path)
    assert rc == 0, out
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    scores, group_ids, masks = dist_worker.global_batch()
    assert ranks[0]["groups"] == [0, 1, 2, 3] and ranks[1]["groups"] == [4, 5, 6]
    assert ranks[0]["seeds"] + ranks[1]["seeds"] == iteration_seeds(11, 5, dist_worker.GROUPS)
    for k, kw in enumerate(dist_worker.FILTERS):
        want = filter_groups(scores, group_ids, **kw)
        got = [r["filters"][k] for r in ranks]
        assert got[0]["indices"] + got[1]["indices"] == want.indices.tolist(), kw
        for r in got:
            assert r["kept_groups"] == want.kept_groups, kw
            assert {int(g): s for g, s in r["group_std"].items()} == want.group_std
            assert (r["kept_ratio"], r["std_before"], r["std_after"], r["zero_std_groups"]) == pytest.approx(
                (want.kept_ratio, want.std_before, want.std_after, want.zero_std_groups), rel=1e-12), kw
    for m, mini in enumerate(dist_worker.MINI_BATCHES):
        tokens = sum(int(masks[i][1:].sum()) for i in mini)
        seqs = sum(1 for i in mini if bool(masks[i][1:].any()))
        for r in ranks:
            assert r["denominators"][f"{m}:counts"] == [tokens, seqs]
            for agg in ("token-mean", "seq-mean-token-mean"):
                assert r["denominators"][f"{m}:{agg}"] == loss_denominator(agg, masks, mini)
    assert [r["on_main"] for r in ranks] == ["written by rank 0"] * 2
    assert open(tmp_path / "main_writes.txt").read() == "rank 0\n"  # written once, by rank 0
    n0, n1 = (len(r["trajectories"]) for r in ranks)
    for r in ranks:
        assert r["means"] == pytest.approx({"x": (n0 + 2 * n1) / (n0 + n1), "y": 10 * (n0 + 2 * n1) / (n0 + n1)})
        assert r["per_rank"] == [100.0, 101.0]


@pytest.mark.parametrize("case", ["raise", "hang"])
def test_a_failed_rank_ends_the_job(tmp_path, case):
    """Rank 1 raises (or hangs) while rank 0 waits in a collective: the job ends with a
    non-zero exit, rank 1's error (or rank 0's timeout) in the output, well before rank 1's
    120 s sleep ends (the collective timeout is 3 s here)."""
    rc, out, secs = _torchrun(["tests/dist_worker.py", case, str(tmp_path)], tmp_path, timeout=100,
                              env={fd.TIMEOUT_ENV: "3"})
    assert rc != 0
    assert secs < 90
    if case == "raise":
        assert "rank 1: the env exploded" in out
    else:
        assert "Timed out" in out


# --- the command line ---------------------------------------------------------------------

@pytest.mark.parametrize("n", ["0", "-3"])
def test_bad_nproc_is_refused(n, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--env", "bandit", "--nproc", n]) == 2
    err = capsys.readouterr().err
    assert f"--nproc {n}: needs a whole number of processes >= 1" in err


def test_nproc_above_one_is_refused_until_the_trainer_is_wired(capsys, monkeypatch, no_model):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--env", "bandit", "--device", "cpu", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "data-parallel training is not wired into the trainer yet" in err and "--nproc 1" in err


def test_nproc_one_is_the_one_process_path(tmp_path, monkeypatch, no_model):
    """--nproc 1 goes on in this process, as without the flag, to the model load."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for extra in ([], ["--nproc", "1"]):
        with pytest.raises(ModelLoadReached):
            main(["train", "--env", "bandit", "--preset", "cpu", "--out", str(tmp_path / f"r{len(extra)}"), *extra])
    assert not torch.distributed.is_initialized()


def test_torchrun_command():
    argv = ["train", "--env", "bandit", "--nproc", "2", "rollout.group_size=4"]
    assert fd.strip_nproc(argv) == ["train", "--env", "bandit", "rollout.group_size=4"]
    assert fd.strip_nproc(["train", "--nproc=3"]) == ["train"]
    cmd = fd.torchrun_command(2, ["train", "--env", "bandit"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastpo",
                   "train", "--env", "bandit"]


def test_plain_torchrun_with_two_processes_is_refused_by_each_rank(tmp_path):
    """`torchrun --nproc_per_node 2 -m fastpo train` (also what --nproc 2 runs): each rank
    refuses before loading anything, and the job exits non-zero."""
    rc, out, _ = _torchrun(["-m", "fastpo", "train", "--env", "bandit", "--device", "cpu",
                            "--out", str(tmp_path / "run")], tmp_path)
    assert rc != 0
    assert "data-parallel training is not wired into the trainer yet" in out
    assert not os.path.exists(tmp_path / "run")


@pytest.fixture(scope="module")
def grad_run(tmp_path_factory):
    """One 2-process run of dist_worker's "grads" case (both exchanges): its folder."""
    out = tmp_path_factory.mktemp("grads")
    rc, log, _ = _torchrun(["tests/dist_worker.py", "grads", str(out)], out)
    assert rc == 0, log
    return out


@pytest.mark.parametrize("case", ["grads", "fsdp"])
def test_two_process_gradient_and_update_equal_one_process(grad_run, case):
    """Data-parallel update pieces on a tiny random Llama: 2 ranks each hold whole env groups,
    divide by the global denominator and sum their gradients (all-reduce with replicated
    parameters, or FSDP2's reduce-scatter with sharded ones, 4 vs 2 micro-batches padded by
    empty ones); the gradient
    equals the one-process gradient of the whole batch within 1e-5 relative (norm per
    parameter) and the parameters after one clipped AdamW step within 1e-5, for token-mean
    and seq-mean-token-mean; the HF folder rank 0 writes loads with those parameters."""
    ranks = [torch.load(grad_run / f"{case}_rank{r}.pt") for r in range(2)]
    assert ranks[0]["trajectories"] == [0, 1, 2, 3] and ranks[1]["trajectories"] == [4, 5]
    group_ids, items = dist_worker.grad_batch(dist_worker.tiny_model())
    for agg in dist_worker.LOSS_AGGS:
        want_g, want_p = dist_worker.data_parallel_step(fd.SINGLE, dist_worker.tiny_model(), items,
                                                        list(range(len(items))), agg)
        for r in ranks:
            got_g, got_p = r["res"][agg]
            for name, g in want_g.items():
                assert g.norm() > 0, name
                err = ((got_g[name] - g).norm() / g.norm()).item()
                assert err <= 1e-5, (agg, name, err)
                perr = ((got_p[name] - want_p[name]).norm() / want_p[name].norm()).item()
                assert perr <= 1e-5, (agg, name, perr)
        # rank 0 wrote one HF folder from the full state dict: it loads, with the updated weights
        from transformers import AutoModelForCausalLM

        saved = dict(AutoModelForCausalLM.from_pretrained(grad_run / f"{case}-model-{agg}").named_parameters())
        for name, p in want_p.items():
            assert ((saved[name].detach() - p).norm() / p.norm()).item() <= 1e-5, (agg, name)
        for name in want_g:  # both ranks hold the same gradient and parameters
            assert torch.equal(ranks[0]["res"][agg][0][name], ranks[1]["res"][agg][0][name])
            assert torch.equal(ranks[0]["res"][agg][1][name], ranks[1]["res"][agg][1][name])
