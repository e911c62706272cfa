"""bench/part_peers.py without TRL or Liger installed: the equal-work check (it must fail
loudly when the two sides' counts differ), the work counts it compares, the numerics check
of the Liger comparison, and the part's one-line skip where the bench extra is missing.
Where the extra is installed, a tiny real TRL step's counts must equal fastpo's."""
import pathlib
import importlib.util
import json
import os
import sys
import types

import pytest
import torch

ROOT = str(pathlib.Path(__file__).resolve().parents[3])
sys.path.insert(0, os.path.join(ROOT, "bench"))
import part_peers  # noqa: E402
from _common import BenchContext, PartSkipped  # noqa: E402

WORK = {"trajectories": 8, "turns": 8, "prompt_tokens": 1696, "generated_tokens": 256, "trajectory_tokens": 1952,
        "updates": 1}


def test_equal_work_passes_when_every_count_matches():
    part_peers.check_equal_work(dict(WORK), dict(WORK), "TRL")


@pytest.mark.parametrize("key", ["generated_tokens", "trajectory_tokens", "prompt_tokens", "updates", "trajectories"])
def test_equal_work_fails_loudly_when_a_count_differs(key):
    peer = dict(WORK, **{key: WORK[key] + 1})
    with pytest.raises(part_peers.EqualWorkError, match=f"{key}: fastpo {WORK[key]} vs TRL {WORK[key] + 1}"):
        part_peers.check_equal_work(dict(WORK), peer, "TRL")


def test_equal_work_names_every_difference_and_missing_counts():
    peer = dict(WORK, generated_tokens=255, updates=2)
    del peer["turns"]
    with pytest.raises(part_peers.EqualWorkError) as e:
        part_peers.check_equal_work(dict(WORK), peer, "TRL")
    msg = str(e.value)
    assert "generated_tokens" in msg and "updates: fastpo 1 vs TRL 2" in msg and "turns: missing (TRL)" in msg


def test_equal_work_tolerance_is_only_for_the_keys_given():
    tol = {"trajectory_tokens": 0.05}
    part_peers.check_equal_work(dict(WORK), dict(WORK, trajectory_tokens=2000), "TRL", tol)  # 2.4%: within
    with pytest.raises(part_peers.EqualWorkError, match="allowed 5%"):
        part_peers.check_equal_work(dict(WORK), dict(WORK, trajectory_tokens=2100), "TRL", tol)
    with pytest.raises(part_peers.EqualWorkError, match="generated_tokens"):
        part_peers.check_equal_work(dict(WORK), dict(WORK, generated_tokens=257), "TRL", tol)


def test_work_counts_of_both_sides():
    from fastpo.rollout.trajectory_batch import TrajectoryBatch

    # two trajectories: prompts of 5 and 4 tokens, 3 model tokens each (the second one in two
    # turns with 2 observation tokens between)
    masks = [torch.tensor([0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool),
             torch.tensor([0, 0, 0, 0, 1, 0, 0, 1, 1], dtype=torch.bool)]
    z = torch.zeros(2)
    batch = TrajectoryBatch(input_ids=[torch.arange(8), torch.arange(9)], loss_mask=masks,
                            sample_logprobs=[torch.zeros(8), torch.zeros(9)], turn_index=[], turn_rewards=z,
                            format_penalty=z, num_turns=torch.tensor([1, 2]), scores=z, success=z, num_actions=z,
                            group_ids=z, seeds=z, truncated=z, stop_reason=[], responses=[], response_texts=[],
                            metrics={})
    fw = part_peers.fastpo_work(batch, updates=1)
    assert fw == {"trajectories": 2, "turns": 3, "prompt_tokens": 9, "generated_tokens": 6, "trajectory_tokens": 17,
                  "updates": 1}
    # TRL's padded tensors for the same two trajectories (left-padded prompts, right-padded completions)
    inputs = {"prompt_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]),
              "completion_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
              "tool_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 1, 1]])}
    tw = part_peers.trl_work(inputs, turns=3, updates=1)
    assert tw == fw
    part_peers.check_equal_work(fw, tw, "TRL")
    inputs["completion_mask"][0, 3] = 1  # one more token on TRL's side: the check fails
    with pytest.raises(part_peers.EqualWorkError):
        part_peers.check_equal_work(fw, part_peers.trl_work(inputs, turns=3, updates=1), "TRL")


def test_numerics_reports_max_differences_and_flags_disagreement():
    g = torch.Generator().manual_seed(0)
    loss, gh, gw = torch.tensor(0.5), torch.randn(4, 3, generator=g), torch.randn(5, 3, generator=g)
    res = {"fastpo": (loss, gh, gw), "same": (loss + 1e-7, gh + 1e-7, gw), "off": (loss, gh * 1.01, gw)}
    out = part_peers.numerics(res, "fastpo")
    assert set(out) == {"same", "off"}
    assert out["same"]["ok"] and out["same"]["loss"] == pytest.approx(1e-7, rel=0.3)
    assert not out["off"]["ok"] and out["off"]["d_hidden"] == pytest.approx(float((gh * 0.01).abs().max()))


def test_part_skips_with_a_one_line_reason_without_the_bench_extra(monkeypatch):
    monkeypatch.setattr(part_peers, "_missing", lambda module, version: f"{module} not importable (x); make bench")
    ctx = BenchContext(quick=True, parts=("peers",))
    with pytest.raises(PartSkipped) as e:
        part_peers.run(ctx)
    assert "trl not importable" in str(e.value) and "liger_kernel not importable" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_missing_package_is_named():
    why = part_peers._missing("fastpo_no_such_module", "1.0")
    assert why.startswith("fastpo_no_such_module not importable") and "make bench" in why


def test_throughput_records_a_skipped_part(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("_bench_throughput", os.path.join(ROOT, "bench", "throughput.py"))
    tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tp)
    fake = types.ModuleType("part_peers")

    def run(ctx):
        raise PartSkipped("trl not importable (ModuleNotFoundError); make bench")

    fake.run = run
    monkeypatch.setitem(sys.modules, "part_peers", fake)
    out = tmp_path / "r.json"
    assert tp.main(["--part", "peers", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["skipped"] == {"peers": "trl not importable (ModuleNotFoundError); make bench"}
    assert d["records"] == [] and d["errors"] == {}


def test_trl_prompt_is_fastpos_first_prompt_at_the_cpu_preset():
    """The prompt the TRL side gets is the one fastpo's rollout renders, the CPU preset's
    closing question (rollout.prompt_examples) included: else the equal-work check fails on
    prompt tokens."""
    from fastpo.config import load_config
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, NativeEngine

    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=0)
    for env in ("bandit", "frozenlake"):
        cfg = load_config(env=env, preset="cpu", overrides=["model.name=random:tiny-llama"])
        assert cfg.rollout.prompt_examples
        ro = MultiTurnRollout(NativeEngine(model, tok), tok, env, dict(cfg.env.options), cfg.rollout.rollout_config())
        for seed in (0, 7):
            assert len(part_peers._prompt_ids(ro, seed)) == ro.prompt_lengths([seed])[0], (env, seed)


@pytest.mark.slow
@pytest.mark.skipif(part_peers._missing("trl", part_peers.TRL_VERSION) is not None, reason="needs the bench extra")
def test_real_trl_step_does_the_same_work_as_fastpo():
    """One warm-up TRL step and one fastpo iteration on a random tiny model at equal work:
    the check inside the part raises if any count differs."""
    ctx = BenchContext(quick=True, model="random:tiny-llama", repeats=1, parts=("peers", "x"))
    recs = part_peers._trl_vs_fastpo(ctx, part_peers.Sizes("bandit", 1, 2, 4))
    names = [r.name for r in recs]
    assert "Bandit: seconds per iteration" in names and all(r.fastpo > 0 and r.baseline > 0 for r in recs)
    assert "2 trajectories, 8 generated tokens" in recs[0].notes


@pytest.mark.slow
@pytest.mark.skipif(part_peers._missing("trl", part_peers.TRL_VERSION) is not None, reason="needs the bench extra")
def test_real_trl_multi_turn_rollout_func_does_the_same_turns_and_tokens():
    """FrozenLake through TRL's rollout_func: every trajectory takes both turns on both sides
    (the goal is out of the action budget's reach), 3 new tokens each."""
    ctx = BenchContext(quick=True, model="random:tiny-llama", repeats=1, parts=("peers", "x"))
    recs = part_peers._trl_vs_fastpo(ctx, part_peers.Sizes("frozenlake", 1, 2, 3, turns=2))
    assert recs[0].name == "FrozenLake 2 turns: seconds per iteration"
    assert "2 trajectories, 12 generated tokens" in recs[0].notes and "rollout_func" in recs[0].baseline_name
