"""fastpo.distributed (issue 14, first phase) and the CLI's --nproc / torchrun handling.

The 2-process checks run tests/dist_worker.py under torchrun with the gloo backend on the
CPU (a few seconds each) and compare every rank's result with the one-process computation
on the concatenated batch.
"""
import pathlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from fastpo.distributed.collectives import on_main, per_rank

from fastpo.distributed.context import DEFAULT_TIMEOUT_S, DistributedError, SINGLE, TIMEOUT_ENV, init_from_env, timeout_seconds, torchrun_env

from fastpo.distributed.data_parallel import global_filter, global_loss_denominator, rank_seeds, split_groups

from fastpo.distributed.launch import check_trainer_support, strip_nproc, torchrun_command
from fastpo.algorithms.filtering import filter_groups
import fastpo.cli
from fastpo.cli import main
from fastpo.seeds import iteration_seeds
from run_helpers import ModelLoadReached

HERE = str(pathlib.Path(__file__).resolve().parents[1])  # tests/: the scripts torchrun starts
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import dist_worker  # noqa: E402


def _child_env(env=None) -> dict:
    """The environment of a child fastpo/torchrun process: one thread, `env` on top, and none
    of a surrounding torchrun's rank variables (the child must not think it is one of its ranks)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        e.pop(k, None)
    return e


def _torchrun(args, tmp_path, timeout=120, nproc=2, env=None):
    """(exit status, output, seconds) of `torchrun --standalone --nproc_per_node nproc ARGS`."""
    e = _child_env(env)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_nodes(args, timeout=180, env=None):
    """(exit statuses, output) of docs/distributed.md's several-node command run as two
    "nodes" on this machine: two torchrun agents, `--nnodes 2 --nproc_per_node 1`, meeting at
    a c10d rendezvous on 127.0.0.1 (a free port); gloo on the CPU. With c10d the rendezvous,
    not the order of start, decides which node holds rank 0."""
    e = _child_env(env)
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
                               "fastpo-test", *args], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], "\n".join(outs)


# --- one process: the helpers are today's computation ------------------------------------

def test_split_groups_keeps_groups_whole_and_balanced():
    for n in range(1, 12):
        for w in range(1, n + 1):
            parts = [split_groups(n, w, r) for r in range(w)]
            assert [g for p in parts for g in p] == list(range(n))  # every group once, in order
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(DistributedError, match="env_groups=2 is below the number of processes \\(3\\)"):
        split_groups(2, 3, 0)
    with pytest.raises(DistributedError, match="rank 2"):
        split_groups(4, 2, 2)


def test_group_seeds_do_not_depend_on_the_world_size():
    full = iteration_seeds(7, 3, 9)
    for w in range(1, 10):
        got = {}
        for r in range(w):
            groups, seeds = rank_seeds(7, 3, 9, w, r)
            got.update(zip(groups, seeds))
        assert [got[g] for g in range(9)] == full


def test_torchrun_variables_are_checked():
    assert torchrun_env({}) is None
    assert torchrun_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(DistributedError, match="RANK is not set"):
        torchrun_env({"WORLD_SIZE": "2"})
    with pytest.raises(DistributedError, match="RANK=2 is outside"):
        torchrun_env({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"})
    with pytest.raises(DistributedError, match="WORLD_SIZE='two'"):
        torchrun_env({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"})
    assert timeout_seconds({}) == DEFAULT_TIMEOUT_S
    assert timeout_seconds({TIMEOUT_ENV: "2.5"}) == 2.5
    with pytest.raises(DistributedError, match="FASTPO_DIST_TIMEOUT_S='0'"):
        timeout_seconds({TIMEOUT_ENV: "0"})


def test_one_process_is_todays_path(monkeypatch):
    """Without torchrun nothing initialises torch.distributed and every helper is the
    one-process computation (the same FilterResult, the trainer's loss denominator)."""
    from fastpo.trainer import loss_denominator

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = init_from_env("cpu")
    assert ctx is SINGLE and not torch.distributed.is_initialized()
    scores, group_ids, masks = dist_worker.global_batch()
    for kw in dist_worker.FILTERS:
        a, b = global_filter(ctx, scores, group_ids, **kw), filter_groups(scores, group_ids, **kw)
        assert a.indices.tolist() == b.indices.tolist() and a.kept_groups == b.kept_groups
        assert (a.group_std, a.kept_ratio, a.std_before, a.std_after) == (b.group_std, b.kept_ratio, b.std_before,
                                                                         b.std_after)
    for mini in dist_worker.MINI_BATCHES:
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            assert global_loss_denominator(ctx, agg, masks, mini) == loss_denominator(agg, masks, mini)
    assert on_main(ctx, lambda x: x + 1, 1) == 2
    assert per_rank(ctx, 3) == [3.0]


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
    # MetricSums over two ranks: the one-process figures of the whole batch (rank 0 alone
    # recorded the only_rank0 keys; no rank counted the optional mean, which is left out)
    from fastpo.trainer.metric_sums import MetricSums

    want = dist_worker.metric_sums(SINGLE, MetricSums, list(scores), masks)
    assert want.pop("dist/rank0/trajectories") == len(masks)
    n0, n1 = (len(r["trajectories"]) for r in ranks)
    for r in ranks:
        got = dict(r["metric_sums"])
        assert (got.pop("dist/rank0/trajectories"), got.pop("dist/rank1/trajectories")) == (n0, n1)
        assert got == pytest.approx(want, rel=1e-12) and "nothing" not in got and got["same"] == 7
        assert re.search(r"'x' is recorded as (max|mean) on one rank and as (mean|max) on another", r["kind_mismatch"])
        assert r["per_rank"] == [100.0, 101.0]


@pytest.mark.parametrize("case", ["raise", "hang"])
def test_a_failed_rank_ends_the_job(tmp_path, case):
    """Rank 1 raises (or hangs) while rank 0 waits in a collective: the job ends with a
    non-zero exit, rank 1's error (or rank 0's timeout) in the output, well before rank 1's
    120 s sleep ends (the collective timeout is 3 s here)."""
    rc, out, secs = _torchrun(["tests/dist_worker.py", case, str(tmp_path)], tmp_path, timeout=100,
                              env={TIMEOUT_ENV: "3"})
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


@pytest.mark.parametrize("extra, says", [
    (["algorithm.is_correction=tis"], "algorithm.is_correction with 2 processes: the importance-sampling "
                                      "correction is not data-parallel yet"),
    (["algorithm.adv_estimator=grpo", "rollout.reuse=2"], "rollout.reuse/rollout.replay with 2 processes"),
    (["algorithm.adv_estimator=grpo", "rollout.sampling_streams=batch"], "rollout.sampling_streams=batch with 2"),
    (["algorithm.adv_estimator=grpo", "rollout.env_groups=1", "optim.mini_batch_size=4"],
     "env_groups=1 is below the number of processes (2)"),
    (["algorithm.adv_estimator=grpo", "model.lora_rank=4"],
     "model.lora_rank with 2 processes: LoRA adapters are not sharded by FSDP2 yet; use "
     "trainer.data_parallel=replicate"),
])
def test_nproc_refuses_what_data_parallel_does_not_support(extra, says, capsys, monkeypatch, no_model):
    """Said in one line, exit status 2, before torchrun starts anything."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(fastpo.cli.processes, "launch_processes", lambda *a: pytest.fail(f"torchrun started: {a}"))
    assert main(["train", "--env", "bandit", "--device", "cpu", "--nproc", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, says", [
    (["train", "--resume", "{tmp}/nope", "--device", "cpu", "--nproc", "2"],
     "{tmp}/nope/config.yaml not found: is {tmp}/nope a fastpo run folder?"),
    (["eval", "--model", "{tmp}/nope", "--device", "cpu", "--nproc", "2"],
     "model.name='{tmp}/nope' cannot be loaded: model folder '{tmp}/nope' does not exist"),
    (["train", "--env", "bandit", "--model", "random:tiny-lama", "--device", "cpu", "--nproc", "2"],
     "model.name='random:tiny-lama' cannot be loaded: unknown random model shape 'tiny-lama'"),
])
def test_nproc_refuses_a_missing_run_or_model_before_torchrun(argv, says, tmp_path, capsys, monkeypatch):
    """A --resume folder that is no run, or a --model that names no model: one line, exit
    status 2, before torchrun starts its processes (each of which would say it again)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(fastpo.cli.processes, "launch_processes", lambda *a: pytest.fail(f"torchrun started: {a}"))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert says.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1, err
    assert out == ""


def test_a_model_that_names_nothing_is_refused_before_anything_prints(tmp_path, capsys, monkeypatch):
    """One process too: the random shape's typo is said before the run's banner."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--env", "bandit", "--model", "random:tiny-lama", "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "unknown random model shape 'tiny-lama'" in err
    assert not (tmp_path / "r").exists()


def test_the_launcher_shares_out_the_cores(monkeypatch):
    """`--nproc N` gives each process OMP_NUM_THREADS = the cores / N (at least 1) unless set
    (torchrun would set 1 and print a banner), and keeps a value the user set."""
    import torch.distributed.run as trun

    seen = []
    monkeypatch.setattr(trun, "run", lambda targs: seen.append(os.environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert fastpo.cli.processes.launch_processes(2, ["train", "--env", "bandit"]) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert fastpo.cli.processes.launch_processes(2, ["train", "--env", "bandit"]) == 0
    assert seen == [str(max(1, cores // 2)), "3"]


def test_lora_is_refused_only_when_sharded():
    from fastpo.config import load_config

    cfg = load_config(env="bandit", overrides=["model.lora_rank=4", "algorithm.adv_estimator=grpo"])
    assert cfg.trainer.data_parallel == "fsdp"  # the default
    with pytest.raises(DistributedError, match="model.lora_rank with 2 processes"):
        check_trainer_support(cfg, 2)
    cfg.trainer.data_parallel = "replicate"
    check_trainer_support(cfg, 2)
    check_trainer_support(cfg, 1)


def test_nproc_one_is_the_one_process_path(tmp_path, monkeypatch, no_model):
    """--nproc 1 goes on in this process, as without the flag, to the model load."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for extra in ([], ["--nproc", "1"]):
        with pytest.raises(ModelLoadReached):
            main(["train", "--env", "bandit", "--preset", "cpu", "--out", str(tmp_path / f"r{len(extra)}"), *extra])
    assert not torch.distributed.is_initialized()


def test_torchrun_command():
    argv = ["train", "--env", "bandit", "--nproc", "2", "rollout.group_size=4"]
    assert strip_nproc(argv) == ["train", "--env", "bandit", "rollout.group_size=4"]
    assert strip_nproc(["train", "--nproc=3"]) == ["train"]
    cmd = torchrun_command(2, ["train", "--env", "bandit"], python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastpo",
                   "train", "--env", "bandit"]


def test_eval_nproc_becomes_torchrun(monkeypatch, no_model):
    """`fastpo eval --nproc 2` runs torchrun's launcher over `fastpo eval` (the same
    arguments but --nproc) in 2 processes; a bad count is refused in one line."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []

    def launch(nproc, argv):  # what torchrun's launcher would run
        seen.append((nproc, argv))
        return 0

    monkeypatch.setattr(fastpo.cli.processes, "launch_processes", launch)
    assert main(["eval", "--env", "bandit", "--device", "cpu", "--nproc", "2", "--seeds", "3"]) == 0
    assert seen == [(2, ["eval", "--env", "bandit", "--device", "cpu", "--seeds", "3"])]
    assert main(["eval", "--env", "bandit", "--nproc", "0"]) == 2


def test_plain_torchrun_refuses_an_unsupported_setting_in_each_rank(tmp_path):
    """`torchrun --nproc_per_node 2 -m fastpo train` with an estimator that is not
    data-parallel yet: each rank refuses before loading anything, rank 0 says why once, and
    the job exits non-zero without creating the run folder."""
    rc, out, _ = _torchrun(["-m", "fastpo", "train", "--env", "bandit", "--device", "cpu", "--preset", "tiny",
                            "algorithm.is_correction=tis", "--out", str(tmp_path / "run")], tmp_path)
    assert rc != 0
    assert out.count("algorithm.is_correction with 2 processes") == 1, out
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
        want_g, want_p = dist_worker.data_parallel_step(SINGLE, dist_worker.tiny_model(), items,
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


def test_gathered_parameters_are_whole_for_generation(grad_run):
    """The trainer's FSDP2 modules: DTensor shards outside `gathered`, whole plain tensors
    inside (the LM-head weight the fused kernels read is the full [vocab, hidden] tensor),
    and rank 0 alone runs forwards and generation there (no collective) with the unsharded
    model's logits and tokens; sharded again after."""
    model = dist_worker.tiny_model()
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for r in range(2):
        got = torch.load(grad_run / f"gathered_rank{r}.pt")
        assert got["sharded_before"] and got["whole_inside"] and got["sharded_after"], got
        assert got["lm_head"] == ("Parameter", (256, 32)) or got["lm_head"] == ("Tensor", (256, 32)), got["lm_head"]
    got = torch.load(grad_run / "gathered_rank0.pt")
    assert torch.allclose(got["logits"], logits, atol=1e-6)
    assert torch.equal(got["tokens"], tokens)


# --- the trainer in several processes -----------------------------------------------------

def test_group_streams_sample_a_group_alike_in_any_batch():
    """With per-group sampling streams (group_ids), an env group's trajectories are the same
    whether it is rolled out alone (its rank's share) or with other groups (one process)."""
    from fastpo.config import RolloutConfig
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, NativeEngine

    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=0)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=6, max_context=2048, temperature=1.0)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, "frozenlake", {"size": 4}, cfg)
    seeds = [11, 12, 13]
    whole = ro.generate(seeds, 3, seed=5, group_ids=[0, 1, 2])
    alone = ro.generate(seeds[1:2], 3, seed=5, group_ids=[1])
    assert whole.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and alone.group_ids.tolist() == [1, 1, 1]
    for j in range(3):
        assert torch.equal(whole.input_ids[3 + j], alone.input_ids[j])
        assert torch.allclose(whole.sample_logprobs[3 + j], alone.sample_logprobs[j], atol=1e-5)
    # the streams differ between groups, and group ids must be one distinct id per seed
    assert not torch.equal(whole.input_ids[0], whole.input_ids[3])
    with pytest.raises(ValueError, match="group_ids must be 1 distinct ints"):
        ro.generate([11], 2, seed=5, group_ids=[0, 1])
    # one batch stream stays today's sampling (what one process runs by default)
    assert torch.equal(ro.generate(seeds, 3, seed=5).input_ids[4], ro.generate(seeds, 3, seed=5).input_ids[4])


#: Eval metrics that measure the engine's work, not the policy: they depend on how the seeds
#: are batched (each batch prefills its shared prompt prefix once, and so on).
EVAL_COST = ("eval/seconds", "eval/engine_seconds", "eval/tokens_per_s", "eval/prefilled_tokens",
             "eval/peak_kv_bytes", "eval/peak_kv_token_bytes")


def test_eval_seed_samples_alike_in_any_chunk():
    """`evaluate_policy` samples each eval seed from its own stream, so the per-trajectory
    results and every eval metric but the engine's cost figures are the same whether the
    seeds run one at a time, two at a time or all in one batch (as on the ranks of a
    sharded evaluation). Scores come from the sampled tokens (tests/dist_train.py), so they
    differ between seeds and samples."""
    from dist_train import token_scores

    from fastpo.config import RolloutConfig
    from fastpo.evaluation.policy import evaluate_policy
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, NativeEngine

    class TokenScored:
        def __init__(self, ro):
            self.ro, self.tokenizer = ro, ro.tokenizer

        def generate(self, *args, **kw):
            b = self.ro.generate(*args, **kw)
            b.scores = token_scores(b)
            b.success = b.scores > 0.5
            return b

    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=0)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=6, max_context=2048, temperature=1.0)
    ro = TokenScored(MultiTurnRollout(NativeEngine(model, tok), tok, "frozenlake", {"size": 4}, cfg))
    runs = [evaluate_policy(ro, [7, 8, 9], 2, 0.5, seed=3, chunk=c) for c in (64, 2, 1)]
    whole = runs[0]
    assert len(set(whole["_per_trajectory"]["score_mean"])) > 1
    assert whole["_per_trajectory"]["seed"] == [7, 7, 8, 8, 9, 9] and len(whole["_batch"]) == 6
    for other in runs[1:]:
        assert other["_per_trajectory"] == whole["_per_trajectory"]
        keys = [k for k in whole if k.startswith("eval/") and k not in EVAL_COST]
        assert {"eval/success_rate", "eval/score_std", "eval/pass@2", "eval/valid_action_rate",
                "eval/response_length_per_turn", "eval/in_group_reward_std"} <= set(keys)
        assert {k: other[k] for k in keys} == {k: whole[k] for k in keys}
    assert len(runs[2]["_batch"]) == 2  # the first chunk's trajectories, for the samples file


def test_trajectory_batches_concatenate_in_order():
    from fastpo.config import RolloutConfig
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, NativeEngine
    from fastpo.rollout.trajectory_batch import TrajectoryBatch, combine_metrics

    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=0)
    cfg = RolloutConfig(max_turns=1, max_new_tokens=4, max_context=2048)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, "bandit", {}, cfg)
    b = ro.generate([1, 2, 3], 2, seed=0, group_ids=[0, 1, 2])
    parts = [b.select([0, 1, 2, 3]), b.select([4, 5])]
    whole = TrajectoryBatch.concat(parts)
    assert whole.group_ids.tolist() == b.group_ids.tolist()
    assert all(torch.equal(x, y) for x, y in zip(whole.input_ids, b.input_ids))
    assert torch.equal(whole.turn_rewards, b.turn_rewards) and whole.stop_reason == b.stop_reason
    m = combine_metrics([{"generated_tokens": 8.0, "seconds": 2.0, "tokens_per_s": 4.0, "num_turns": 1.0},
                         {"generated_tokens": 4.0, "seconds": 1.0, "tokens_per_s": 4.0, "num_turns": 4.0}], [3, 1])
    assert m == {"generated_tokens": 12.0, "seconds": 2.0, "tokens_per_s": 6.0, "num_turns": 1.75}
    with pytest.raises(ValueError):
        TrajectoryBatch.concat([])


#: A tiny StarPO-S GRPO run: 4 env groups x 2 (the 2 ranks hold 2 each), top 50% by reward
#: std, one trajectory per micro-batch (several micro-batches per optimizer step),
#: scores from the sampled tokens (tests/dist_train.py), a checkpoint every iteration; each
#: env group samples from its own stream in one process too (what "auto" gives several), so
#: the trajectories do not depend on the number of processes, across the resume as well. A KL
#: term (k3, in the loss) to the reference model, with a learning rate that moves the policy
#: away from it at once: a resume must measure it against the run's starting model.
TRAIN = ["--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--device", "cpu",
         "trainer.plots=false", "trainer.collapse_every=2", "rollout.env_groups=4", "rollout.group_size=2",
         "algorithm.adv_estimator=grpo", "algorithm.filter_mode=top", "algorithm.filter_ratio=0.5",
         "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k3", "optim.actor_lr=1e-4",
         "optim.micro_token_budget=16", "trainer.keep_checkpoints=5", "trainer.eval_every=0",
         "rollout.sampling_streams=group"]
#: The dp_runs' evaluation: before training and after every iteration, on an odd number of
#: seeds (rank 0 plays 2, rank 1 one), 2 samples each.
EVAL = ["trainer.eval_every=1", "trainer.eval_seeds=3", "trainer.eval_group_size=2", "trainer.eval_before_training=true"]
#: Metrics that are timings, sizes of this process's buffers, or per-rank figures.
NOT_COMPARED = ("time/", "perf/", "dist/", "ema/time/", "ema/perf/", "ema/dist/")


def _python(args, timeout=180, env=None):
    e = _child_env(env)
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _records(run, before: bool = False):
    """metrics.jsonl's records; `before`: with iteration 0's (the evaluation before training)."""
    with open(run / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if before or r["iteration"] > 0]


def _weights(run, it):
    """{file/tensor name: tensor} of every safetensors file in checkpoint `it` (the model, and
    the critic's value head and body where there is one)."""
    import glob

    from safetensors.torch import load_file

    folder = str(run / "checkpoints" / f"iter_{it:06d}")
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True)):
        out.update({f"{os.path.relpath(path, folder)}:{k}": v for k, v in load_file(path).items()})
    return out


def _same_metrics(a: dict, b: dict):
    keys = [k for k in a if k in b and not k.startswith(NOT_COMPARED) and "seconds" not in k and "per_s" not in k
            and "peak_kv_" not in k and k != "model"
            # work counts, not results: each rank's engine prefills once the prompt prefix its groups share
            and "prefilled_tokens" not in k]
    assert len(keys) > 40
    for k in keys:
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    return keys


def _same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        err = ((a[name] - b[name]).norm() / a[name].norm().clamp_min(1e-12)).item()
        assert err <= 1e-5, (name, err)


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """One process for 3 iterations; two processes (torchrun, gloo; FSDP2, the default) for 1
    iteration, resumed with one process to 2, then with two processes again to 3; two
    replicating processes (trainer.data_parallel=replicate) for 1 iteration. Each evaluates
    before training and after every iteration (EVAL)."""
    root = tmp_path_factory.mktemp("dp")
    one, two, rep = root / "one", root / "two", root / "rep"
    note = {"FASTPO_TEST_TEARDOWN_NOTE": "1"}
    rc, out_one = _python(["tests/dist_train.py", "train", *TRAIN, *EVAL, "--iterations", "3", "--out", str(one)],
                          env=note)
    assert rc == 0, out_one
    rc, out, _ = _torchrun(["tests/dist_train.py", "train", *TRAIN, *EVAL, "--iterations", "1", "--out", str(two)],
                           root, timeout=180)
    assert rc == 0, out
    first = _records(two)
    w1 = _weights(two, 1)
    files = sorted(os.listdir(two))
    rc, out = _python(["tests/dist_train.py", "train", "--resume", str(two), "--iterations", "2"])
    assert rc == 0, out
    rc, out_two, _ = _torchrun(["tests/dist_train.py", "train", "--resume", str(two), "--iterations", "3"], root,
                               timeout=180, env=note)
    assert rc == 0, out_two
    rc, out, _ = _torchrun(["tests/dist_train.py", "train", *TRAIN, *EVAL, "trainer.data_parallel=replicate",
                            "--iterations", "1", "--out", str(rep)], root, timeout=180)
    assert rc == 0, out
    return {"one": one, "two": two, "two_first": first, "two_w1": w1, "two_files": files, "rep": rep,
            "out_one": out_one, "out_two": out_two}


def test_torchrun_ranks_end_without_interpreter_teardown(dp_runs):
    """A finished torchrun rank leaves through fastpo.distributed.context.end_process, not the
    interpreter's teardown, in which torch (FSDP2 and torch._dynamo used) still destroys the
    gloo process group and may abort (SIGABRT: a finished job reported failed). One process
    ends normally (the atexit hook's line printed: the hook works)."""
    assert "dist_train: interpreter teardown" in dp_runs["out_one"]
    out = dp_runs["out_two"]
    assert "outputs in" in out  # rank 0's summary, printed before the end
    assert "dist_train: interpreter teardown" not in out


def test_only_rank_0_shows_progress_bars(dp_runs):
    """Both ranks of the resume load the checkpoint's weights; transformers' loading bar is
    rank 0's alone (fastpo.cli.processes.quiet_progress_bars on the others)."""
    assert dp_runs["out_two"].count("Loading weights: 100%") == 1, dp_runs["out_two"][-3000:]


def test_two_processes_train_as_one(dp_runs):
    """The 2-process iteration equals the 1-process one: the same trajectories and scores,
    the same groups kept by the global StarPO-S filter, the same metrics (rollout, filter,
    advantages, update means, gradient norm, collapse), and parameters after the update
    within 1e-5; rank 0 alone wrote the run folder, with each rank's times and peak memory."""
    one, first = _records(dp_runs["one"]), dp_runs["two_first"]
    assert [r["iteration"] for r in first] == [1]
    a, b = one[0], first[0]
    assert 0 < b["train/filter_kept_ratio"] < 1 and b["train/in_group_reward_std_kept"] > 0
    assert b["actor/grad_norm"] > 1e-3  # the scores' spread reaches the gradient
    keys = _same_metrics(a, b)
    assert {"train/score_mean", "train/filter_kept_ratio", "train/advantage_std", "actor/grad_norm",
            "actor/pg_loss", "collapse/mi_estimate", "train/rollout_entropy"} <= set(keys)
    _same_weights(_weights(dp_runs["one"], 1), dp_runs["two_w1"])
    for r in (0, 1):
        for name in ("rollout_s", "update_s", "peak_memory_mib"):
            assert b[f"dist/rank{r}/{name}"] > 0
    assert "dist/rank2/update_s" not in b
    assert dp_runs["two_files"] == sorted(os.listdir(dp_runs["one"]))  # what one process writes, nothing more


def test_sharded_evaluation_equals_one_process(dp_runs):
    """Two processes share out the eval seeds (3 seeds: 2 on rank 0, 1 on rank 1; FSDP2's
    parameters gathered whole on each), and rank 0 gathers the trajectories: the per-seed
    outcomes (eval/iter_*.json) and every eval metric but the engine's cost figures equal one
    process evaluating all seeds, before training and after each iteration (iterations 1 and
    3 evaluated by two processes, 2 by one after the resume); the replicated exchange too."""
    one, two = _records(dp_runs["one"], before=True), _records(dp_runs["two"], before=True)
    assert [r["iteration"] for r in one] == [0, 1, 2, 3] == [r["iteration"] for r in two]
    for it in range(4):
        a, b = (json.loads((run / "eval" / f"iter_{it:06d}.json").read_text()) for run in (dp_runs["one"],
                                                                                         dp_runs["two"]))
        assert a == b, it
        assert len(a["seed"]) == 6 and len(set(a["seed"])) == 3 and len(set(a["score_mean"])) > 1
        keys = [k for k in one[it] if k.startswith("eval/") and k not in EVAL_COST]
        assert len(keys) > 15 and {k: two[it][k] for k in keys} == {k: one[it][k] for k in keys}, it
    for it in (0, 1, 3):  # each rank evaluated its share
        assert (two[it]["dist/rank0/eval_seeds"], two[it]["dist/rank1/eval_seeds"]) == (2, 1)
        assert two[it]["dist/rank1/eval_rollout_s"] > 0
    assert not any(k.startswith("dist/") for k in two[2])
    rep = _records(dp_runs["rep"], before=True)
    for it in (0, 1):
        assert json.loads((dp_runs["rep"] / "eval" / f"iter_{it:06d}.json").read_text()) == json.loads(
            (dp_runs["one"] / "eval" / f"iter_{it:06d}.json").read_text())
        assert rep[it]["dist/rank1/eval_seeds"] == 1


def _digests(run) -> dict:
    """{checkpoint file: SHA-256} of every weight file (safetensors) in the run's checkpoints."""
    import glob
    import hashlib

    return {os.path.relpath(p, run): hashlib.sha256(open(p, "rb").read()).hexdigest()
            for p in sorted(glob.glob(os.path.join(str(run), "checkpoints", "iter_*", "**", "*.safetensors"),
                                      recursive=True))}


def test_two_nodes_train_checkpoint_and_resume_as_one_node(dp_runs, tmp_path):
    """docs/distributed.md's several-node torchrun command, as two nodes of one process each
    on this machine (c10d rendezvous on 127.0.0.1): iteration 1 on the two nodes, iteration 2
    resumed by one process, iteration 3 resumed on the two nodes again (each node reads the
    checkpoint from the shared folder): the dp_runs two-process run on one node does the
    same, and every record (metrics, sharded evaluations included) and every checkpoint's
    weights are the same bit for bit."""
    run = tmp_path / "nodes"
    codes, out = _two_nodes(["tests/dist_train.py", "train", *TRAIN, *EVAL, "--iterations", "1", "--out", str(run)])
    assert codes == [0, 0], out
    rc, out = _python(["tests/dist_train.py", "train", "--resume", str(run), "--iterations", "2"])
    assert rc == 0, out
    codes, out = _two_nodes(["tests/dist_train.py", "train", "--resume", str(run), "--iterations", "3"])
    assert codes == [0, 0], out
    got, want = _records(run, before=True), _records(dp_runs["two"], before=True)
    assert [r["iteration"] for r in got] == [0, 1, 2, 3]
    for a, b in zip(want, got):
        keys = [k for k in a if not k.startswith(NOT_COMPARED) and not k.endswith(("_s", "seconds", "tokens_per_s"))]
        assert set(keys) <= set(b) and len(keys) > 40
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}, a["iteration"]
    assert got[3]["dist/rank1/eval_seeds"] == 1 and got[1]["dist/rank1/trajectories"] >= 0
    digests = _digests(run)
    assert len(digests) == 3 and digests == _digests(dp_runs["two"])
    assert sorted(os.listdir(run)) == sorted(os.listdir(dp_runs["two"]))


def test_fastpo_eval_in_two_processes_equals_one(dp_runs, tmp_path):
    """`fastpo eval` under torchrun (2 processes, gloo) of the one-process run's last
    checkpoint, on its eval seeds (3 x 2 samples: rank 0 plays 2 seeds, rank 1 one): the
    same metrics, but the cost figures, as that run's own one-process evaluation of the
    same weights; rank 0 alone prints the table and writes the JSON and the samples."""
    rc, out, _ = _torchrun(["tests/dist_train.py", "eval", "--model", str(dp_runs["one"]), "--device", "cpu",
                            "--seeds", "3", "--k", "2", "--json", str(tmp_path / "two.json"), "--samples",
                            str(tmp_path / "s")], tmp_path)
    assert rc == 0, out
    assert out.count("fastpo eval: bandit") == 1 and "in 2 processes" in out, out
    got = json.loads((tmp_path / "two.json").read_text())["metrics"]
    want = {k[len("eval/"):]: v for k, v in _records(dp_runs["one"])[-1].items()
            if k.startswith("eval/") and k not in EVAL_COST}
    assert len(want) > 15 and want["score_std"] > 0 and {k: got[k] for k in want} == want
    assert os.listdir(tmp_path / "s") == ["iter_000003.txt"]


def test_two_process_checkpoint_resumes_with_one_process(dp_runs):
    """Iteration 2 of the 2-process run, resumed from its checkpoint by one process, equals
    iteration 2 of the uninterrupted 1-process run (metrics and parameters): the checkpoint
    holds the full model and optimizer state, whatever the world size, and the KL term is
    measured against the run's starting model, not the checkpoint's policy."""
    one, two = _records(dp_runs["one"]), _records(dp_runs["two"])
    assert [r["iteration"] for r in two] == [1, 2, 3]
    assert one[1]["actor/kl"] > 1e-5  # the policy left the reference: KL to the wrong model would show
    _same_metrics(one[1], two[1])
    assert not any(k.startswith("dist/") for k in two[1])  # one process: no per-rank figures
    _same_weights(_weights(dp_runs["one"], 2), _weights(dp_runs["two"], 2))


def test_one_process_checkpoint_resumes_with_two_sharded_processes(dp_runs):
    """And back: iteration 3, resumed with two FSDP2 processes from the checkpoint one process
    wrote (whole optimizer state, sharded on load), equals the uninterrupted 1-process run's
    (metrics, parameters and the optimizer state in the checkpoint): every rank's reference
    model is rank 0's starting model (broadcast), not the checkpoint's policy."""
    one, two = _records(dp_runs["one"]), _records(dp_runs["two"])
    assert one[2]["actor/kl"] > 1e-5
    _same_metrics(one[2], two[2])
    assert two[2]["dist/rank1/trajectories"] >= 0 and "dist/rank0/parameter_mib" in two[2]
    _same_weights(_weights(dp_runs["one"], 3), _weights(dp_runs["two"], 3))
    a, b = (torch.load(run / "checkpoints" / "iter_000003" / "optimizer.pt", weights_only=False)
            for run in (dp_runs["one"], dp_runs["two"]))
    assert a.keys() == b.keys() == {"actor"}
    assert sorted(a["actor"]["state"]) == sorted(b["actor"]["state"]) and len(a["actor"]["state"]) > 5
    for i, st in a["actor"]["state"].items():
        for k, v in st.items():
            assert b["actor"]["state"][i][k].shape == v.shape, (i, k)
            err = ((b["actor"]["state"][i][k].double() - v.double()).norm() / v.double().norm().clamp_min(1e-12)).item()
            assert err <= 1e-5, (i, k, err)


def test_sharded_processes_equal_replicated_ones(dp_runs):
    """FSDP2 (the default with several processes) and the replicated exchange
    (trainer.data_parallel=replicate) give the same iteration (metrics; parameters within
    1e-5); under FSDP2 each rank holds about half the parameters and optimizer state, the
    two halves together the whole that each replicating rank holds."""
    fsdp, rep = dp_runs["two_first"][0], _records(dp_runs["rep"])[0]
    _same_metrics(rep, fsdp)
    _same_weights(_weights(dp_runs["rep"], 1), dp_runs["two_w1"])
    for name in ("parameter_mib", "optimizer_state_mib"):
        whole = rep[f"dist/rank0/{name}"]
        assert whole > 0 and rep[f"dist/rank1/{name}"] == whole
        halves = [fsdp[f"dist/rank{r}/{name}"] for r in (0, 1)]
        assert max(halves) < 0.6 * whole and sum(halves) == pytest.approx(whole, rel=0.02), (name, halves, whole)


def test_torchrun_with_one_process_takes_the_data_parallel_path(dp_runs, tmp_path):
    """`torchrun --nproc_per_node 1` joins a process group of one (gloo here; NCCL on one GPU:
    the smoke test of this path) and trains as the one-process run does."""
    rc, out, _ = _torchrun(["tests/dist_train.py", "train", *TRAIN, "--iterations", "1", "--out", str(tmp_path / "r")],
                           tmp_path, nproc=1)
    assert rc == 0, out
    b = _records(tmp_path / "r")[0]
    assert b["dist/rank0/trajectories"] == 4 and "dist/rank1/trajectories" not in b  # 2 of 4 groups kept
    _same_metrics(_records(dp_runs["one"])[0], b)
    _same_weights(_weights(dp_runs["one"], 1), _weights(tmp_path / "r", 1))


def test_ctrl_c_saves_one_checkpoint_from_rank_0(tmp_path):
    """`fastpo train --nproc 2` (torchrun under the hood), interrupted by Ctrl-C (SIGINT to
    the whole process group, which torchrun's agent forwards again): the ranks agree to stop,
    rank 0 saves the last complete iteration once and says so once; the job ends as one
    process does, exit 130 without torchrun's SignalException report (it exited 1 with a
    25-line traceback), well within torchrun's grace period."""
    import signal

    out = tmp_path / "run"
    args = [sys.executable, "-m", "fastpo", "train", "--nproc", "2", "--env", "bandit", "--preset", "tiny", "--model",
            "random:tiny-llama", "--device", "cpu", "trainer.plots=false", "trainer.collapse_every=0",
            "rollout.env_groups=2", "algorithm.adv_estimator=grpo", "trainer.save_every=0", "trainer.eval_every=0",
            "--iterations", "500", "--out", str(out)]
    e = _child_env()
    p = subprocess.Popen(args, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() - t0 < 120, "no iteration finished"
            time.sleep(0.3)
        os.killpg(p.pid, signal.SIGINT)
        log, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, log
    for noise in ("Traceback", "SignalException", "ChildFailedError", "torch.distributed.elastic"):
        assert noise not in log, log
    done = len(_records(out))
    assert sorted(os.listdir(out / "checkpoints")) == [f"iter_{done:06d}", "latest"], log
    assert log.count("checkpoint: ") == 1 and log.count("stopping all processes") == 1, log
    assert done < 500


def test_a_failing_rank_ends_the_training_job(tmp_path):
    """Rank 1's rollout raises in iteration 2: the job ends non-zero with rank 1's message and
    status (1), no hang (rank 0's collective fails when rank 1 is gone), iteration 1's
    checkpoint kept."""
    out = tmp_path / "run"
    rc, log, secs = _torchrun(["tests/dist_train.py", "train", *TRAIN, "trainer.collapse_every=0", "--iterations", "4",
                               "--out", str(out)], tmp_path, timeout=150,
                              env={"FASTPO_TEST_FAIL_RANK": "1", "FASTPO_TEST_FAIL_ITERATION": "2",
                                   TIMEOUT_ENV: "60"})
    assert rc != 0
    assert "RuntimeError: rank 1: the env exploded in iteration 2" in log
    # rank 1 ends with status 1 (fastpo.cli.entry, after leaving the group), not a teardown's signal
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: 1 \(", log), log[-3000:]
    assert secs < 120
    assert [r["iteration"] for r in _records(out)] == [1]
    assert "iter_000001" in os.listdir(out / "checkpoints")


@pytest.mark.parametrize("case", ["empty-rank", "reinforce_pp_baseline"])
def test_other_estimators_in_two_processes_equal_one(tmp_path, case):
    """One iteration in 2 processes equals one process (metrics, and every parameter in the
    checkpoint within 1e-5). "empty-rank": PPO with a separate critic (values per rank,
    advantages whitened over the global batch, the critic's value loss over global
    denominators and its own optimizer's summed gradients; both ranks holding trajectories:
    the next test) where rank 1's groups have no reward spread, so the filter keeps only rank
    0's and rank 1 joins the update with nothing. "reinforce_pp_baseline": its normalisation
    over every rank's tokens, with the soft advantage reweighting (the largest group std of
    the global batch) and a KL term to the reference model in the loss."""
    if case == "reinforce_pp_baseline":
        gae = [*TRAIN, "algorithm.adv_estimator=reinforce_pp_baseline", "algorithm.soft_advantage_reweight=true",
               "algorithm.kl_coef=0.05", "trainer.collapse_every=0", "--iterations", "1"]
    else:
        gae = [*TRAIN, "algorithm.adv_estimator=gae", "algorithm.critic=separate", "trainer.collapse_every=0",
               "--iterations", "1"]
    env = {"FASTPO_TEST_FLAT_FROM": "2"} if case == "empty-rank" else {}
    rc, out = _python(["tests/dist_train.py", "train", *gae, "--out", str(tmp_path / "one")], env=env)
    assert rc == 0, out
    rc, out, _ = _torchrun(["tests/dist_train.py", "train", *gae, "--out", str(tmp_path / "two")], tmp_path,
                           timeout=180, env={TIMEOUT_ENV: "60", **env})
    assert rc == 0, out
    a, b = _records(tmp_path / "one")[0], _records(tmp_path / "two")[0]
    if case == "empty-rank":
        assert b["train/in_group_reward_std_kept"] > 0 and b["train/filter_kept_ratio"] == 0.5
        assert b["dist/rank0/trajectories"] == 4 and b["dist/rank1/trajectories"] == 0
    keys = _same_metrics(a, b)
    wa, wb = _weights(tmp_path / "one", 1), _weights(tmp_path / "two", 1)
    _same_weights(wa, wb)
    if case == "reinforce_pp_baseline":
        assert {"train/soft_reweight_max", "train/soft_reweight_mean", "actor/kl", "train/advantage_std"} <= set(keys)
        assert 0 < b["train/soft_reweight_mean"] < 1
        return
    assert {"critic/return_mean", "critic/value_mean", "critic/grad_norm", "train/advantage_std"} <= set(keys)
    assert b["critic/grad_norm"] > 0
    assert any(k.startswith("critic") for k in wa) and any(k.startswith("model") for k in wa)


def test_dynamic_sampling_in_two_processes_draws_and_keeps_as_one(tmp_path):
    """DAPO's dynamic sampling with `--nproc 2`: each process rolls out its share of every
    extra draw; the draws, the varying groups found and kept, and every training figure are
    one process's (FrozenLake, the random tiny model, a reward of its responses' parity so that
    some groups vary and others not: extra draws are needed and some groups are kept)."""
    from run_helpers import train_one_and_two_processes

    one, two = train_one_and_two_processes(tmp_path, [
              "--env", "frozenlake", "--preset", "tiny", "--model", "random:tiny-llama", "rollout.env_groups=4",
              "algorithm.adv_estimator=grpo", "algorithm.filter_mode=dynamic", "algorithm.dynamic_max_draws=3",
              "trainer.iterations=1", "trainer.eval_every=0", "trainer.progress=false", "trainer.plots=false",
              "rollout.group_size=2", "reward.fn=run_helpers:response_parity", "reward.mode=replace",
              "rollout.sampling_streams=group"])  # one process samples as two
    assert any(r["train/dynamic_draws"] > 1 for r in one), "the case should need extra draws"
    assert any(r["train/dynamic_varying_groups"] > 0 for r in one), "and keep some groups"
    assert len(one) == len(two) == 1  # (later iterations follow weights summed in another order)
    for ra, rb in zip(one, two):
        for k in ("train/dynamic_draws", "train/dynamic_varying_groups", "train/filter_kept_ratio",
                  "train/success_rate", "train/score_mean", "train/in_group_reward_std_kept", "actor/grad_norm"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (ra["iteration"], k)


#: A run whose update has several optimizer steps (2 epochs of mini-batches of 4 and 2 of the 6
#: trajectories of the 3 kept groups) and whose ranks hold unequal shares of them (2 and 4), each
#: rank's share of a mini-batch packed in one micro-batch (the tiny preset's budget): a mean of
#: micro-batch means differs from one process's; FrozenLake (several turns), GAE with a separate
#: critic, a KL term in the loss, the soft reweighting.
UNEVEN = ["--env", "frozenlake", "--preset", "tiny", "--model", "random:tiny-llama", "--device", "cpu",
          "trainer.plots=false", "trainer.collapse_every=0", "trainer.eval_every=0", "rollout.env_groups=4",
          "rollout.group_size=2", "rollout.sampling_streams=group", "algorithm.adv_estimator=gae",
          "algorithm.critic=separate", "algorithm.filter_mode=top", "algorithm.filter_ratio=0.75",
          "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=false", "algorithm.soft_advantage_reweight=true",
          "optim.mini_batch_size=4", "optim.ppo_epochs=2", "optim.actor_lr=1e-4", "--iterations", "1"]


def test_update_and_rollout_metrics_do_not_depend_on_the_number_of_processes(tmp_path):
    """The same data in one process and in two log the same figures, and end with the same
    weights of the policy and of its separate critic: the update's per-token ones are means
    over all the iteration's tokens (not means of each micro-batch's mean, which
    depend on how the processes split a mini-batch), its extremes (ratio_max / _min) over all
    of them, pg_loss the mean over the optimizer steps of each step's whole loss term, and the
    rollout's figures are those of the whole batch."""
    rc, out = _python(["tests/dist_train.py", "train", *UNEVEN, "--out", str(tmp_path / "one")])
    assert rc == 0, out
    rc, out, _ = _torchrun(["tests/dist_train.py", "train", *UNEVEN, "--out", str(tmp_path / "two")], tmp_path,
                           timeout=180, env={TIMEOUT_ENV: "60"})
    assert rc == 0, out
    a, b = _records(tmp_path / "one")[0], _records(tmp_path / "two")[0]
    assert a["actor/updates"] == 4 and b["dist/rank0/trajectories"] != b["dist/rank1/trajectories"]
    assert {k for k in a if not k.startswith(NOT_COMPARED)} == {k for k in b if not k.startswith(NOT_COMPARED)}
    keys = _same_metrics(a, b)
    update = {"actor/entropy", "actor/clipfrac", "actor/approx_kl", "actor/ratio_mean", "actor/ratio_max",
              "actor/ratio_min", "actor/kl", "actor/pg_loss", "actor/grad_norm", "critic/value_loss",
              "critic/value_clipfrac", "critic/value_error", "critic/grad_norm"}
    rollout = {"train/success_rate", "train/score_std", "train/in_group_reward_std", "train/response_length",
               "train/response_length_per_turn", "train/valid_action_rate", "train/format_valid",
               "train/rollout_entropy", "train/advantage_std", "train/soft_reweight_min", "critic/return_mean"}
    assert update | rollout <= set(keys), sorted(update | rollout - set(keys))
    assert b["critic/grad_norm"] > 0
    # every parameter of the policy and of the critic, after the 4 optimizer steps, within 1e-5
    wa, wb = _weights(tmp_path / "one", 1), _weights(tmp_path / "two", 1)
    assert any(k.startswith("critic") for k in wa) and any(k.startswith("model") for k in wa)
    _same_weights(wa, wb)
