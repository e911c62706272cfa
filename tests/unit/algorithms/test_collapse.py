"""Mutual-information collapse metrics: the packed cross log-prob matrix against pair-by-pair
scoring, the estimators against their definitions written out by hand, the reasoning cut,
and the Echo-Trap warning naming the collapse."""
from __future__ import annotations
import pathlib

import math

import pytest
import torch

from fastpo.trainer.collapse import (batch_collapse_metrics, cross_logprobs, cross_logprobs_naive, first_turn_pairs,
                             mutual_information_metrics, reasoning_tokens)
from fastpo.report.metrics import EchoTrapDetector
from fastpo.model_loading import load_model_and_tokenizer
from fastpo.packing import use_segment_attention


@pytest.fixture(scope="module")
def tiny():
    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=0)
    use_segment_attention(model)  # as the trainer does
    return model, tok


def _rand(n, seed, vocab=49000):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_packed_cross_matrix_equals_pair_by_pair_and_costs_less(tiny):
    model, _ = tiny
    prompts = [_rand(n, s) for s, n in enumerate((30, 25, 41))]
    responses = [_rand(n, 100 + s) for s, n in enumerate((5, 9, 1, 12, 7, 3))]
    naive = cross_logprobs_naive(model, prompts, responses, temperature=0.7)
    shared = cross_logprobs(model, prompts, responses, temperature=0.7, token_budget=8192)
    pairs = cross_logprobs(model, prompts, responses, temperature=0.7, share_prompt=False, token_budget=8192)
    small = cross_logprobs(model, prompts, responses, temperature=0.7, token_budget=60)  # a prompt's row split
    for other in (shared, pairs, small):
        assert other.sums.shape == (6, 3)
        torch.testing.assert_close(other.sums, naive.sums, atol=1e-4, rtol=0)
    z = sum(len(r) for r in responses)
    # one row per prompt holds it once: sum_j (|x_j| + sum_i |z_i|); pair by pair: sum_j sum_i (|x_j| + |z_i|)
    assert shared.tokens == sum(len(x) + z for x in prompts) == 3 * 37 + 96
    assert pairs.tokens == naive.tokens == sum(6 * len(x) + z for x in prompts)
    assert shared.forwards == 1 and naive.forwards == 18
    assert small.tokens > shared.tokens and small.forwards > 1
    with pytest.raises(ValueError, match="at least one token"):
        cross_logprobs(model, prompts, [torch.tensor([], dtype=torch.long)])


def _by_definition(sums, lengths, own, group_cols):
    """RAGEN's estimators written out with one column per env group (duplicated prompts
    included), plain Python: the reference the tensor code is held to."""
    G = len(group_cols)
    out = {}
    for suffix, per_token in (("", True), ("_seq", False)):
        matched, marginal = [], []
        for i in range(len(lengths)):
            row = [float(sums[i][group_cols[g]]) / (lengths[i] if per_token else 1) for g in range(G)]
            own_col = [g for g in range(G) if group_cols[g] == own[i]][0]
            matched.append(row[own_col])
            marginal.append(math.log(sum(math.exp(v) for v in row)) - math.log(G))
        n = len(matched)
        out[f"collapse/mi{suffix}_estimate"] = sum(a - b for a, b in zip(matched, marginal)) / n
        out[f"collapse/conditional_entropy{suffix}_est"] = -sum(matched) / n
        out[f"collapse/reasoning_entropy{suffix}_est"] = -sum(marginal) / n
    return out


def test_estimators_match_their_definition_with_duplicate_prompts():
    g = torch.Generator().manual_seed(3)
    sums = -torch.rand(7, 3, generator=g, dtype=torch.float64) * 40
    lengths = torch.tensor([3, 8, 1, 5, 2, 9, 4])
    own = torch.tensor([0, 0, 1, 1, 2, 2, 0])
    # four env groups: groups 0 and 3 share prompt 0 -> weights 2/4, 1/4, 1/4
    group_cols = [0, 1, 2, 0]
    got = mutual_information_metrics(sums, lengths, own, torch.tensor([0.5, 0.25, 0.25]))
    want = _by_definition(sums.tolist(), lengths.tolist(), own.tolist(), group_cols)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-9), k
    assert got["collapse/mi_upper_bound"] == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    uniform = mutual_information_metrics(sums, lengths, own)
    assert uniform["collapse/mi_upper_bound"] == pytest.approx(math.log(3))
    # I = H(Z) - H(Z|X), both ways
    assert got["collapse/mi_estimate"] == pytest.approx(got["collapse/reasoning_entropy_est"]
                                                        - got["collapse/conditional_entropy_est"])
    # retrieval: argmax of the per-token row against the own prompt
    hits = [int((sums[i] / lengths[i]).argmax()) == int(own[i]) for i in range(7)]
    assert got["collapse/retrieval_accuracy"] == pytest.approx(sum(hits) / 7)
    assert got["collapse/retrieval_chance_level"] == pytest.approx((3 * 0.5 + 4 * 0.25) / 7)


def test_template_and_entropy_collapse_read_right():
    # every response equally likely under every prompt: no dependence on the state, I = 0
    flat = torch.full((4, 2), -6.0, dtype=torch.float64)
    m = mutual_information_metrics(flat, torch.tensor([3, 3, 3, 3]), torch.tensor([0, 0, 1, 1]))
    assert abs(m["collapse/mi_estimate"]) < 1e-12 and m["collapse/conditional_entropy_est"] == pytest.approx(2.0)
    # each response certain under its own prompt, impossible under the other: I = log 2, H(Z|X) = 0
    sharp = torch.tensor([[0.0, -1e4], [0.0, -1e4], [-1e4, 0.0], [-1e4, 0.0]], dtype=torch.float64)
    m = mutual_information_metrics(sharp, torch.tensor([1, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
    assert m["collapse/mi_estimate"] == pytest.approx(math.log(2)) and m["collapse/conditional_entropy_est"] == 0
    assert m["collapse/retrieval_accuracy"] == 1.0


def test_reasoning_cut_at_the_close_tag(tiny):
    _, tok = tiny
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    ids = enc(" go left, then down </think> <answer> Left </answer>") + [eot]
    z, closed = reasoning_tokens(ids, tok, "</think>")
    # the space before the tag is in the token " </": Z ends before it (RAGEN strips it from the text)
    assert closed and tok.decode(z) == " go left, then down"
    z, closed = reasoning_tokens(enc(" still thinking about it"), tok, "</think>")
    assert not closed and tok.decode(z) == " still thinking about it"
    z, closed = reasoning_tokens(enc(" go</think><answer>Up</answer>") + [eot], tok)  # tag glued to the text
    assert closed and tok.decode(z) == " go"
    assert reasoning_tokens(enc("</think> <answer> Up </answer>"), tok) == ([], True)
    z, closed = reasoning_tokens(enc(" Phoenix </answer>") + [eot], tok, "</answer>")  # answer-only mode
    assert closed and tok.decode(z) == " Phoenix"


def _rollout(model, tok, seeds, group_size, think=True):
    from fastpo.rollout import MultiTurnRollout, NativeEngine, RolloutConfig

    cfg = RolloutConfig(max_turns=1, max_new_tokens=10, temperature=0.8, think=think)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, "frozenlake", {}, cfg)
    return ro.generate(seeds, group_size, seed=1)


def test_a_group_holding_two_prompts_weighs_both(tiny):
    """An env group whose trajectories saw different prompts (an env that ignores its seed):
    each prompt counts for that group; before, the group's last prompt alone counted, an
    earlier one got weight 0 and the metrics raised ValueError."""
    model, tok = tiny
    batch = _rollout(model, tok, [3, 4], 2)  # groups 0, 0, 1, 1 over seeds 3, 3, 4, 4
    batch.group_ids = torch.tensor([0, 0, 0, 1])  # group 0 saw seed 3's and seed 4's prompt
    pairs = first_turn_pairs(batch, tok, think=True)
    assert len(pairs.prompts) == 2 and pairs.weights.tolist() == pytest.approx([1 / 3, 2 / 3])
    got = batch_collapse_metrics(model, tok, batch, think=True, temperature=0.8, token_budget=8192)
    assert got["collapse/num_prompts"] == 2 and math.isfinite(got["collapse/mi_estimate"])


@pytest.mark.parametrize("seeds", [[3, 4, 5], [3, 3, 4]])
def test_batch_metrics_match_pair_by_pair_scoring(tiny, seeds):
    """A real rollout's first turns: the packed metrics within 1e-4 of every pair scored
    separately, the matched log-probs equal to the sampler's, identical prompts merged."""
    model, tok = tiny
    batch = _rollout(model, tok, seeds, 3)
    pairs = first_turn_pairs(batch, tok, think=True)
    distinct = len(set(seeds))
    assert pairs.total == 9 and len(pairs.prompts) == distinct and len(pairs.responses) == 9 - pairs.empty
    # the random model never closes </think> in 10 tokens: each Z is its whole response (end token removed)
    for b, z in enumerate(pairs.responses):
        r = batch.responses[b][0]
        assert torch.equal(z, r[:-1] if int(r[-1]) in tok.all_special_ids else r)
    got = batch_collapse_metrics(model, tok, batch, think=True, temperature=0.8, token_budget=8192)
    naive = cross_logprobs_naive(model, pairs.prompts, pairs.responses, temperature=0.8)
    # the group columns as RAGEN builds them: one per env group, its prompt's scores
    group_cols = [int(pairs.prompt_of[3 * g]) for g in range(3)]
    want = _by_definition(naive.sums.tolist(), naive.lengths.tolist(), pairs.prompt_of.tolist(), group_cols)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-4), k
    assert got["collapse/num_prompts"] == distinct and got["collapse/num_responses"] == 9
    assert got["collapse/closed_rate"] == 0 and got["collapse/valid_rate"] == 1
    # matched = the log-prob the sampler recorded for those tokens, at the same temperature
    for i in range(9):
        n = len(pairs.responses[i])
        sampled = float(batch.sample_logprobs[i][batch.loss_mask[i]][:n].sum())
        assert float(naive.sums[i, pairs.prompt_of[i]]) == pytest.approx(sampled, abs=1e-4)


def test_one_distinct_prompt_gives_counts_only(tiny):
    model, tok = tiny
    got = batch_collapse_metrics(model, tok, _rollout(model, tok, [7], 3), temperature=0.8)
    assert got["collapse/num_prompts"] == 1 and "collapse/mi_estimate" not in got


def _rec(it, std, ent, succ, mi=None, hzx=None):
    r = {"iteration": it, EchoTrapDetector.STD_KEY: std, EchoTrapDetector.ENT_KEY: ent,
         EchoTrapDetector.SUCCESS_KEY: succ}
    if mi is not None:
        r.update({EchoTrapDetector.MI_KEY: mi, EchoTrapDetector.HZX_KEY: hzx, EchoTrapDetector.BOUND_KEY: math.log(8)})
    return r


def test_echo_trap_warning_names_the_collapse():
    # template collapse: MI halves while std, entropy and H(Z|X) hold (entropy alone would never warn)
    det = EchoTrapDetector(drop=0.5, window=2)
    assert det.update(_rec(1, 0.4, 2.0, 0.1, mi=0.8, hzx=1.5)) is None
    assert det.update(_rec(2, 0.4, 2.0, 0.1)) is None
    assert det.update(_rec(3, 0.4, 2.0, 0.1, mi=0.5, hzx=1.5)) is None  # fell, by less than half
    msg = det.update(_rec(4, 0.4, 2.0, 0.1, mi=0.3, hzx=1.4))
    assert msg and "template collapse" in msg and "entropy collapse" not in msg and "reward std" not in msg
    assert det.update(_rec(5, 0.4, 2.0, 0.1)) == msg  # no new measurement: the latest still holds
    assert det.update(_rec(6, 0.4, 2.0, 0.5)) is None  # success rose: learning
    # entropy collapse beside the paper's sign
    det = EchoTrapDetector(drop=0.5, window=1)
    det.update(_rec(1, 0.4, 2.0, 0.1, mi=0.8, hzx=1.5))
    msg = det.update(_rec(2, 0.1, 0.5, 0.1, mi=0.7, hzx=0.5))
    assert "entropy collapse" in msg and "reward std" in msg and "template" not in msg
    # the paper's sign, the MI metrics holding: it says neither collapse shows there
    det = EchoTrapDetector(drop=0.5, window=1)
    det.update(_rec(1, 0.4, 2.0, 0.1, mi=0.8, hzx=1.5))
    msg = det.update(_rec(2, 0.1, 0.5, 0.1, mi=0.7, hzx=1.2))
    assert "neither entropy nor template collapse" in msg
    # no collapse metrics at all: the kind is unknown
    det = EchoTrapDetector(drop=0.5, window=1)
    det.update(_rec(1, 0.4, 2.0, 0.1))
    assert "unknown" in det.update(_rec(2, 0.1, 0.5, 0.1))


def test_bench_part_runs_quick():
    """`bench/throughput.py --part collapse` end to end at --quick sizes on the tiny model."""
    import os
    import sys

    sys.path.insert(0, os.path.join(str(pathlib.Path(__file__).resolve().parents[3]), "bench"))
    import part_collapse
    from _common import BenchContext

    recs = part_collapse.run(BenchContext(quick=True, model="random:tiny-llama", repeats=1, parts=("collapse",)))
    tokens = recs[0]
    assert tokens.unit == "tokens" and tokens.baseline > tokens.fastpo > 0 and tokens.target == 3.0
    assert [r.unit for r in recs] == ["tokens", "s", "s"] and all(r.ratio and r.ratio > 0 for r in recs)
    assert "max |fastpo - plain reference|" in tokens.notes


def test_plot_curves_draws_the_collapse_figure(tmp_path):
    import os

    from fastpo.report.plots import plot_curves

    recs = [{"iteration": i, "train/success_rate": 0.1 * i, "collapse/mi_estimate": 0.5 / i,
             "collapse/conditional_entropy_est": 1.0, "collapse/reasoning_entropy_est": 1.0 + 0.5 / i,
             "collapse/mi_upper_bound": math.log(4)} for i in (1, 2, 3)]
    paths = plot_curves(recs, str(tmp_path))
    assert str(tmp_path / "collapse.png") in paths and os.path.getsize(tmp_path / "collapse.png") > 5000
    plot_curves([{"iteration": 1, "train/success_rate": 0.2}], str(tmp_path / "none"))
    assert "collapse.png" not in os.listdir(tmp_path / "none")
