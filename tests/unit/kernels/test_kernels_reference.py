"""fastpo.kernels: the specification (reference) and the chunked PyTorch path.

The reference materializes fp32 logits; the per-token loss terms are checked against
hand-computed values, and both the reference and the chunked path against
torch.autograd.gradcheck in float64.
"""
import math

import pytest
import torch

from fastpo.kernels import (PolicyLossSettings, aggregation_weights, linear_logprob_entropy, linear_policy_loss,
                            policy_loss_terms, reference_logprob_entropy)

from kernel_data import lm_head_data as _data




# ---- the per-token loss formula against hand-computed numbers ----

def test_policy_terms_clip_higher_by_hand():
    lp = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    old = torch.log(torch.tensor([1 / 1.5, 1 / 1.1, 1 / 0.5, 1 / 0.9, 1.0]))  # ratios 1.5, 1.1, 0.5, 0.9, 1
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0, 3.0])
    t = policy_loss_terms(lp, torch.zeros(5), old, adv, clip_low=0.2, clip_high=0.28)
    r = torch.tensor([1.5, 1.1, 0.5, 0.9, 1.0])
    torch.testing.assert_close(t["ratio"], r)
    # A>0, r=1.5 > 1.28: clipped to 1.28; A<0, r=0.5 < 0.8: clipped to 0.8
    expected = torch.tensor([-2 * 1.28, -2 * 1.1, 1 * 0.8, 1 * 0.9, -3.0])
    torch.testing.assert_close(t["pg"], expected)
    assert t["clip_high"].tolist() == [True, False, False, False, False]
    assert t["clip_low"].tolist() == [False, False, True, False, False]
    # A<0 with a large ratio is not clipped by PPO (pessimistic max), only by the dual clip
    lp2, old2, adv2 = torch.tensor([0.0]), torch.log(torch.tensor([1 / 5.0])), torch.tensor([-1.0])
    assert policy_loss_terms(lp2, torch.zeros(1), old2, adv2)["pg"].item() == pytest.approx(5.0)
    t2 = policy_loss_terms(lp2, torch.zeros(1), old2, adv2, dual_clip=3.0)
    assert t2["pg"].item() == pytest.approx(3.0) and t2["dual_clip"].item()


def test_policy_terms_kl_and_entropy_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    ent = torch.tensor([2.0, 3.0])
    k1 = policy_loss_terms(lp, ent, lp, torch.zeros(2), ref, kl_coef=1.0, kl_estimator="k1")
    torch.testing.assert_close(k1["kl"], lp - ref)
    k3 = policy_loss_terms(lp, ent, lp, torch.zeros(2), ref, kl_coef=0.5, entropy_coef=0.1, kl_estimator="k3")
    d = ref - lp
    torch.testing.assert_close(k3["kl"], torch.exp(d) - d - 1)
    torch.testing.assert_close(k3["loss"], -0.1 * ent + 0.5 * (torch.exp(d) - d - 1))
    assert bool((k3["kl"] >= 0).all())


def test_aggregation_weights_by_hand():
    m = torch.tensor([1, 1, 0, 1, 1, 1, 0])
    sid = torch.tensor([7, 7, 7, 3, 3, 3, 9])  # seq 9 has no masked-in token: not counted
    torch.testing.assert_close(aggregation_weights(m, "token-mean"), m / 5.0)
    torch.testing.assert_close(aggregation_weights(m, "seq-mean-token-sum", sid), m / 2.0)
    torch.testing.assert_close(aggregation_weights(m, "seq-mean-token-mean", sid),
                               torch.tensor([1 / 4, 1 / 4, 0, 1 / 6, 1 / 6, 1 / 6, 0]))
    torch.testing.assert_close(aggregation_weights(m, "token-mean", denominator=10), m / 10.0)
    assert aggregation_weights(torch.zeros(4), "token-mean").abs().sum() == 0
    with pytest.raises(ValueError, match="seq_ids"):
        aggregation_weights(m, "seq-mean-token-mean")


# ---- numerics of the reference and the chunked path ----

@pytest.mark.parametrize("v", [1000, 997, 33])
def test_logprob_nonpositive_and_matches_log_softmax(v):
    hidden, weight, targets = _data(48, 40, v, scale=3.0)
    for impl in ("reference", "chunked"):
        lp, ent = linear_logprob_entropy(hidden, weight, targets, impl=impl, chunk_size=13)
        logits = hidden.double() @ weight.double().T
        ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
        assert lp.dtype == torch.float32 and ent.dtype == torch.float32
        assert bool((lp <= 0).all()), impl
        torch.testing.assert_close(lp.double(), ref, atol=2e-5, rtol=1e-5)
        assert bool((ent >= 0).all()) and bool((ent <= math.log(v) + 1e-4).all())


def _with_bias(hidden, weight, bias):
    """Append a constant-1 feature so that logits = hidden @ weight.T + bias."""
    h = torch.cat([hidden, torch.ones(hidden.shape[0], 1, dtype=hidden.dtype)], 1)
    w = torch.cat([weight, torch.full((weight.shape[0], 1), bias, dtype=weight.dtype)], 1)
    return h, w


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_all_negative_logits_and_temperature(temperature):
    hidden, weight, targets = _data(32, 24, 517)
    h, w = _with_bias(hidden, weight, -50.0)
    lp_shift, ent_shift = linear_logprob_entropy(h, w, targets, temperature, impl="chunked", chunk_size=8)
    lp, ent = reference_logprob_entropy(hidden.double(), weight.double(), targets, temperature)
    # a constant shift of all logits changes neither log-probs nor entropy
    torch.testing.assert_close(lp_shift.double(), lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent_shift.double(), ent, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gradcheck_logprob_entropy(temperature):
    hidden, weight, targets = _data(6, 5, 11, dtype=torch.float64)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    for impl in ("reference", "chunked"):
        def f(h, w):
            lp, ent = linear_logprob_entropy(h, w, targets, temperature, impl=impl, chunk_size=4)
            return lp, ent
        assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-6, atol=1e-6), impl


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradcheck_policy_loss(loss_agg):
    n = 9
    hidden, weight, targets = _data(n, 5, 13, dtype=torch.float64, seed=1)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.5)
    # old log-probs away from the clip kinks so that finite differences are valid
    old = lp + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    ref = lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    sid = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
    kw = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.1, temperature=0.5, loss_agg=loss_agg,
              seq_ids=sid)
    for impl in ("reference", "chunked"):
        def f(h, w):
            return linear_policy_loss(h, w, targets, old, adv, mask, ref, impl=impl, chunk_size=4, **kw).loss
        # fast mode (random projections of the Jacobian): each loss call also syncs its metrics
        assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-6, atol=1e-6, fast_mode=True), impl


def test_chunked_matches_reference_mid_size():
    n, h, v = 512, 64, 3001
    hidden, weight, targets = _data(n, h, v, seed=3, scale=2.0)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.7)
    old = lp + 0.3 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    ref = lp + 0.3 * torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.25
    sid = torch.arange(n) // 37
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.001, kl_coef=0.05, kl_estimator="k1",
              temperature=0.7, loss_agg="seq-mean-token-mean", seq_ids=sid)
    outs, grads = {}, {}
    for impl in ("reference", "chunked"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        outs[impl] = linear_policy_loss(hh, ww, targets, old, adv, mask, ref, impl=impl, chunk_size=100, **kw)
        outs[impl].loss.backward()
        grads[impl] = (hh.grad, ww.grad)
    a, b = outs["chunked"], outs["reference"]
    torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a.logprob, b.logprob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=1e-5)
    for x, y in zip(grads["chunked"], grads["reference"]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-4)
    for k, val in b.metrics.items():
        assert a.metrics[k] == pytest.approx(val, abs=1e-5, rel=1e-4), k
    assert a.metrics["clipfrac"] > 0 and a.metrics["clipfrac_high"] > 0 and a.metrics["clipfrac_low"] > 0


def test_bf16_inputs_fp32_outputs():
    hidden, weight, targets = _data(64, 48, 1000, dtype=torch.bfloat16, seed=5, scale=2.0)
    g_lp, g_ent = torch.randn(64), torch.randn(64)
    res = {}
    for impl in ("reference", "chunked"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = linear_logprob_entropy(hh, ww, targets, 0.5, impl=impl, chunk_size=16)
        assert lp.dtype == ent.dtype == torch.float32
        (lp * g_lp + ent * g_ent).sum().backward()
        assert hh.grad.dtype == ww.grad.dtype == torch.bfloat16
        res[impl] = (lp, ent, hh.grad.float(), ww.grad.float())
    for x, y in zip(res["chunked"][:2], res["reference"][:2]):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for x, y in zip(res["chunked"][2:], res["reference"][2:]):
        torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2)


def test_masked_tokens_get_exactly_zero_gradient():
    n = 40
    hidden, weight, targets = _data(n, 16, 300, seed=6)
    mask = torch.arange(n) % 3 == 0
    # masked-out entries hold garbage that must not leak
    old = torch.where(mask, -torch.rand(n), torch.full((n,), -torch.inf))
    adv = torch.where(mask, torch.randn(n), torch.full((n,), torch.nan))
    for impl in ("reference", "chunked"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, entropy_coef=0.01, impl=impl, chunk_size=7)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert bool((hh.grad[~mask] == 0).all()), impl
        assert bool(hh.grad[mask].abs().sum() > 0) and torch.isfinite(ww.grad).all()
        # the weight gradient equals the one from only the masked-in rows
        h2, w2 = hidden[mask].clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out2 = linear_policy_loss(h2, w2, targets[mask], old[mask], adv[mask], torch.ones(int(mask.sum())),
                                  entropy_coef=0.01, impl=impl)
        out2.loss.backward()
        torch.testing.assert_close(ww.grad, w2.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out.loss, out2.loss)


def test_on_policy_ratio_exactly_one():
    hidden, weight, targets = _data(100, 32, 777, seed=7)
    mask = torch.ones(100, dtype=torch.bool)
    for impl in ("reference", "chunked"):
        with torch.no_grad():
            old, _ = linear_logprob_entropy(hidden, weight, targets, 0.5, impl=impl)
        out = linear_policy_loss(hidden.requires_grad_(True), weight, targets, old, torch.randn(100), mask,
                                 temperature=0.5, impl=impl)
        hidden.requires_grad_(False)
        m = out.metrics
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["clipfrac"] == 0.0, (impl, m)
        assert m["approx_kl"] == 0.0


def test_entropy_gradient_finite_with_underflowing_probabilities():
    # huge logits: most probabilities underflow to exactly 0 in fp32
    hidden, weight, targets = _data(16, 8, 500, seed=8, scale=400.0)
    for impl in ("reference", "chunked"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = linear_logprob_entropy(hh, ww, targets, impl=impl)
        ent.sum().backward()
        assert torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all(), impl
        assert torch.isfinite(lp).all() and bool((ent >= 0).all())


def test_bad_inputs_raise_clear_errors():
    hidden, weight, targets = _data(4, 8, 10)
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="'cuda-magic'"):
        linear_logprob_entropy(hidden, weight, targets, impl="cuda-magic")
    with pytest.raises(ValueError, match="found 10"):
        linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_entropy(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        linear_logprob_entropy(hidden, weight[:, :5], targets)
    with pytest.raises(TypeError, match="integer"):
        linear_logprob_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="'token-sum'"):
        linear_policy_loss(hidden, weight, targets, z, z, z, loss_agg="token-sum")
    with pytest.raises(ValueError, match="'k2'"):
        linear_policy_loss(hidden, weight, targets, z, z, z, kl_estimator="k2")
    with pytest.raises(ValueError, match="dual_clip"):
        linear_policy_loss(hidden, weight, targets, z, z, z, dual_clip=0.5)
    with pytest.raises(ValueError, match="ref_logprob"):
        linear_policy_loss(hidden, weight, targets, z, z, z, kl_coef=0.1)
    with pytest.raises(ValueError, match="seq_ids"):
        linear_policy_loss(hidden, weight, targets, z, z, z, loss_agg="seq-mean-token-sum")
    with pytest.raises(ValueError, match="advantages"):
        linear_policy_loss(hidden, weight, targets, z, torch.zeros(5), z)
    if not torch.cuda.is_available():
        import os
        if os.environ.get("TRITON_INTERPRET") != "1":
            with pytest.raises(ValueError, match="CUDA"):
                linear_logprob_entropy(hidden, weight, targets, impl="triton")


def test_cu_seqlens_equals_seq_ids():
    hidden, weight, targets = _data(10, 8, 50, seed=9)
    old, adv, mask = -torch.rand(10), torch.randn(10), torch.ones(10)
    a = linear_policy_loss(hidden, weight, targets, old, adv, mask, loss_agg="seq-mean-token-mean",
                           cu_seqlens=torch.tensor([0, 3, 3, 10]))
    b = linear_policy_loss(hidden, weight, targets, old, adv, mask, loss_agg="seq-mean-token-mean",
                           seq_ids=torch.tensor([0, 0, 0, 2, 2, 2, 2, 2, 2, 2]))
    torch.testing.assert_close(a.loss, b.loss)
    with pytest.raises(ValueError, match="cu_seqlens"):
        linear_policy_loss(hidden, weight, targets, old, adv, mask, cu_seqlens=torch.tensor([0, 3, 9]))


def test_mixed_dtypes_and_autocast():
    hidden, weight, targets = _data(24, 16, 200, seed=10)
    z, adv, mask = torch.zeros(24), torch.randn(24), torch.ones(24)
    # bf16 hidden with an fp32 head: computed in fp32, gradients in each input's dtype
    hb = hidden.bfloat16().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = linear_policy_loss(hb, w, targets, z, adv, mask, impl="chunked")
    out.loss.backward()
    assert hb.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    ref = linear_policy_loss(hb.detach().float(), weight, targets, z, adv, mask, impl="reference")
    torch.testing.assert_close(out.loss, ref.loss)
    # inside autocast the head runs in autocast's dtype, the logits stay fp32
    w2 = weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = linear_logprob_entropy(hidden, w2, targets, impl="chunked")
    lr, er = reference_logprob_entropy(hidden.bfloat16(), weight.bfloat16(), targets)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, lr, atol=1e-5, rtol=1e-5)
    lp.sum().backward()
    assert w2.grad.dtype == torch.float32 and torch.isfinite(w2.grad).all()


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_no_scored_tokens(impl):
    hidden, weight, targets = _data(0, 8, 20)
    z = torch.zeros(0)
    h = hidden.requires_grad_(True)
    out = linear_policy_loss(h, weight, targets, z, z, z, loss_agg="seq-mean-token-mean",
                             seq_ids=torch.zeros(0, dtype=torch.long), impl=impl)
    assert out.loss.item() == 0.0 and out.metrics["ratio_max"] == 0.0 and out.metrics["clipfrac"] == 0.0
    out.loss.backward()
    assert h.grad.shape == (0, 8)
    hidden, weight, targets = _data(5, 8, 20)
    out = linear_policy_loss(hidden, weight, targets, torch.zeros(5), torch.ones(5), torch.zeros(5), impl=impl)
    assert out.loss.item() == 0.0 and out.metrics["entropy"] == 0.0




def test_auto_falls_back_to_chunked_when_triton_fails(monkeypatch):
    from fastpo.kernels import api

    class Broken:
        INTERPRET = True

        @staticmethod
        def triton_stats(*a, **k):
            raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(api, "_triton_module", lambda: Broken)
    monkeypatch.setattr(api, "_triton_failed", None)
    hidden, weight, targets = _data(8, 8, 50)
    with pytest.warns(RuntimeWarning, match="simulated compile failure"):
        lp, ent, _ = api._stats("triton-auto", hidden, weight, targets, 1.0, None)
    ref_lp, ref_ent = reference_logprob_entropy(hidden, weight, targets)
    torch.testing.assert_close(lp, ref_lp)
    assert api._triton_failed is not None
    assert api.resolve_impl("auto", torch.device("cuda")) == "chunked"  # never retried
    with pytest.raises(RuntimeError, match="simulated"):  # an explicit impl="triton" never falls back
        api._stats("triton", hidden, weight, targets, 1.0, None)


# ---- metrics, non-finite masked rows, accumulation precision, backward, validation ----

def test_policy_metrics_by_hand():
    from fastpo.kernels import policy_metrics

    r = [1.5, 1.1, 0.5, 0.9, 2.0]
    lp = torch.tensor([0.0, 0.0, 0.0, 0.0, math.nan])  # the masked-out token holds NaN
    old = -torch.log(torch.tensor(r))  # ratios exp(lp - old) = r on the four masked-in tokens
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0, 1.0])
    ent = torch.tensor([1.0, 2.0, 3.0, 4.0, math.inf])
    ref = torch.tensor([-1.0, 0.0, 0.5, 0.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    terms = policy_loss_terms(lp, ent, old, adv, ref, clip_low=0.2, clip_high=0.28, kl_estimator="k3")
    w = aggregation_weights(mask, "token-mean")
    m = policy_metrics(terms, ent, lp, old, mask, w, with_kl=True)
    # token 0: A > 0 and r = 1.5 > 1.28 (high clip); token 2: A < 0 and r = 0.5 < 0.8 (low clip)
    assert m["clipfrac_high"] == pytest.approx(0.25) and m["clipfrac_low"] == pytest.approx(0.25)
    assert m["clipfrac"] == pytest.approx(0.5) and m["clipfrac_dual"] == 0.0
    kl_old = sum((x - 1.0) - math.log(x) for x in r[:4]) / 4  # k3 of KL(old || new), from the ratio
    assert m["approx_kl"] == pytest.approx(kl_old, rel=1e-5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 0.9) / 4, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5, rel=1e-6) and m["ratio_min"] == pytest.approx(0.5, rel=1e-6)
    assert m["entropy"] == pytest.approx(2.5)
    # pg = max(-A r, -A clip(r)): -2 * 1.28, -2 * 1.1, 1 * 0.8, 1 * 0.9; token-mean over 4
    assert m["pg_loss"] == pytest.approx((-2.56 - 2.2 + 0.8 + 0.9) / 4, rel=1e-5)
    k3 = [math.exp(d) - d - 1.0 for d in (-1.0, 0.0, 0.5, 0.0)]  # ref - lp
    assert m["kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)
    assert all(math.isfinite(x) for x in m.values()), m


def test_nonfinite_hidden_row_under_mask_zero_changes_nothing():
    n = 24
    hidden, weight, targets = _data(n, 16, 97, seed=11, scale=2.0)
    mask = torch.ones(n, dtype=torch.bool)
    mask[[3, 10, 17]] = False
    bad = hidden.clone()
    bad[3], bad[10, 5], bad[17, 0] = math.nan, math.inf, -math.inf
    g = torch.Generator().manual_seed(12)
    old = -torch.rand(n, generator=g) - 3.0
    adv, ref = torch.randn(n, generator=g), -torch.rand(n, generator=g) - 3.0
    kw = dict(entropy_coef=0.01, kl_coef=0.1, clip_high=0.28, loss_agg="seq-mean-token-mean",
              seq_ids=torch.arange(n) // 6)
    for impl in ("reference", "chunked"):
        res = []
        for h in (hidden, bad):
            hh, ww = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            out = linear_policy_loss(hh, ww, targets, old, adv, mask, ref, impl=impl, chunk_size=8, **kw)
            out.loss.backward()
            res.append((out, hh.grad, ww.grad))
        (a, ah, aw), (b, bh, bw) = res
        assert torch.isfinite(b.loss) and torch.isfinite(bw).all(), impl
        assert bool((bh[~mask] == 0).all()) and torch.isfinite(bh).all(), impl
        torch.testing.assert_close(b.loss, a.loss, atol=0, rtol=0)
        torch.testing.assert_close(bw, aw, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(bh, ah, atol=1e-7, rtol=1e-6)
        for k, val in a.metrics.items():
            assert b.metrics[k] == pytest.approx(val, rel=1e-6, abs=1e-7), (impl, k, b.metrics)
        # masked-in tokens are reported as before; the poisoned rows report what they are
        torch.testing.assert_close(b.logprob[mask], a.logprob[mask], atol=0, rtol=0)
        assert torch.isnan(b.logprob[3]) and torch.isfinite(a.logprob[~mask]).all(), impl
    # the grad-free evaluation path too
    with torch.no_grad():
        out = linear_policy_loss(bad, weight, targets, old, adv, mask, ref, impl="chunked", **kw)
    assert torch.isfinite(out.loss) and all(math.isfinite(x) for x in out.metrics.values())


def fp64_weight_grad(hidden, weight, targets, g_lp, g_ent, temperature):
    """d weight [V, H] in float64 and its error scale: sum over tokens of |dlogits| |hidden|
    (a sum of N terms computed with unit roundoff u is off by at most about u times that)."""
    h = hidden.double()
    logits = (h @ weight.double().T).requires_grad_(True)
    logp = torch.log_softmax(logits / temperature, -1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return logits.grad.T @ h, logits.grad.abs().T @ h.abs()


def accumulation_error(x, ref_and_scale):
    """max over entries of |x - ref| / (sum of the absolute contributions to that entry)."""
    ref, scale = ref_and_scale
    return ((x.double() - ref).abs() / scale.clamp(min=1e-30)).max().item()


def many_tile_case(n=1024, h=16, v=61, seed=13):
    """Nearly equal hidden rows, one target: every token adds about the same, same-signed
    amount to each entry of d weight, the case where a low-precision running sum over token
    tiles stalls (a bf16 accumulator over 128 chunks of 8 rows is 9.5% off)."""
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(h, generator=g, dtype=torch.float64)
    hidden = h0 + 0.02 * torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    targets = torch.full((n,), 7, dtype=torch.long)
    g_lp = 1.0 + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.full((n,), 0.5, dtype=torch.float64)
    return hidden, weight, targets, g_lp, g_ent


# bf16: the returned d weight is bf16 (one rounding, <= 2^-8 of an entry); fp32: fp32 all along
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-3)])
def test_weight_gradient_accumulates_in_fp32_over_many_chunks(dtype, tol):
    hidden, weight, targets, g_lp, g_ent = many_tile_case()
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    ww = weight.clone().requires_grad_(True)
    lp, ent = linear_logprob_entropy(hidden, ww, targets, 0.5, impl="chunked", chunk_size=8)  # 128 chunks
    (lp * g_lp.float() + ent * g_ent.float()).sum().backward()
    err = accumulation_error(ww.grad, fp64_weight_grad(hidden, weight, targets, g_lp, g_ent, 0.5))
    assert err <= tol, f"d weight off by {err:.3g} of its contributions' size (tolerance {tol:g})"


def test_policy_loss_backward_scales_the_stored_gradient_in_place():
    n = 30
    hidden, weight, targets = _data(n, 12, 83, seed=14)
    g = torch.Generator().manual_seed(15)
    old, adv = -torch.rand(n, generator=g) - 4.0, torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.3
    grads = {}
    for impl in ("reference", "chunked"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, entropy_coef=0.01, impl=impl, chunk_size=7)
        if impl == "chunked":
            stored = out.loss.grad_fn.saved_tensors[1].data_ptr()
        # the upstream gradient of the loss is 2.5 + 0.5 = 3, not 1
        (2.5 * out.loss + 0.5 * out.loss + hh.sum() * 0).backward()
        grads[impl] = (hh.grad, ww.grad)
    torch.testing.assert_close(grads["chunked"][0], grads["reference"][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads["chunked"][1], grads["reference"][1], atol=1e-6, rtol=1e-5)
    assert grads["chunked"][1].data_ptr() == stored, "d weight was copied instead of scaled in place"
    # a second backward through the retained graph would scale twice: autograd refuses it
    hh = hidden.clone().requires_grad_(True)
    out = linear_policy_loss(hh, weight, targets, old, adv, mask, impl="chunked")
    (2.0 * out.loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        (2.0 * out.loss).backward()


def test_sequence_ids_offsets_and_mask_validation():
    hidden, weight, targets = _data(10, 8, 50, seed=16)
    old, adv, mask = -torch.rand(10), torch.randn(10), torch.ones(10)
    kw = dict(loss_agg="seq-mean-token-sum")
    a = linear_policy_loss(hidden, weight, targets, old, adv, mask, cu_seqlens=[0, 3, 3, 10], **kw)
    b = linear_policy_loss(hidden, weight, targets, old, adv, mask, cu_seqlens=torch.tensor([0, 3, 3, 10]), **kw)
    # negative ids name sequences like any others
    c = linear_policy_loss(hidden, weight, targets, old, adv, mask,
                           seq_ids=torch.tensor([-5, -5, -5, -1, -1, -1, -1, -1, -1, -1]), **kw)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(c.loss, b.loss)
    with pytest.raises(TypeError, match="cu_seqlens must be an integer tensor, got torch.float32"):
        linear_policy_loss(hidden, weight, targets, old, adv, mask, cu_seqlens=[0.0, 3.5, 10.0], **kw)
    with pytest.raises(ValueError, match=r"got \[0, 3, 9\]"):
        linear_policy_loss(hidden, weight, targets, old, adv, mask, cu_seqlens=[0, 3, 9], **kw)
    with pytest.raises(TypeError, match="seq_ids must be an integer tensor, got torch.float32"):
        linear_policy_loss(hidden, weight, targets, old, adv, mask, seq_ids=torch.zeros(10), **kw)
    neg = mask.clone()
    neg[4] = -1.0
    with pytest.raises(ValueError, match="loss_mask must be finite and >= 0, found -1.0 at index 4"):
        linear_policy_loss(hidden, weight, targets, old, adv, neg)
    nan = mask.clone()
    nan[2] = math.nan
    with pytest.raises(ValueError, match="found nan at index 2"):
        linear_policy_loss(hidden, weight, targets, old, adv, nan)
    with pytest.raises(ValueError, match="found -2 at index 0"):
        linear_policy_loss(hidden, weight, targets, old, adv, torch.tensor([-2, 1, 1, 1, 1, 1, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match="dual_clip must be None or a finite constant > 1, got inf"):
        linear_policy_loss(hidden, weight, targets, old, adv, mask, dual_clip=math.inf)


# ---- GSPO's sequence ratio and importance-sampling weights (issue 13) ----

def test_sequence_log_ratio_by_hand():
    from fastpo.kernels import sequence_log_ratio

    lp = torch.tensor([-1.0, -2.0, -0.5, -1.0, -3.0, -1.0])
    old = torch.tensor([-1.2, -2.6, -0.5, -0.4, math.nan, -1.0])  # token 4 masked out: NaN must not leak
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 2.0])  # a float mask weights the mean
    sid = torch.tensor([5, 5, 5, 8, 8, 8])
    # sequence 5: (0.2 + 0.6 + 0) / 3; sequence 8: (1 * -0.6 + 2 * 0) / 3
    expected = torch.tensor([0.8 / 3] * 3 + [-0.2] * 3)
    torch.testing.assert_close(sequence_log_ratio(lp, old, mask, sid), expected)
    # a sequence with no masked-in token gets 0
    assert sequence_log_ratio(lp[:3], old[:3], torch.zeros(3), sid[:3]).abs().sum() == 0


def test_policy_terms_sequence_ratio_by_hand():
    from fastpo.kernels import sequence_log_ratio

    # two sequences; sequence 0 moved up by log 1.5 per token on average, sequence 1 down by log 0.5
    lp = torch.zeros(4, requires_grad=True)
    old = torch.log(torch.tensor([1 / 1.2, 1 / 1.875, 1 / 0.5, 1 / 0.5]))  # geometric means 1.5 and 0.5
    adv = torch.tensor([2.0, 2.0, -1.0, 3.0])
    sid = torch.tensor([0, 0, 1, 1])
    slr = sequence_log_ratio(lp, old, torch.ones(4), sid)
    t = policy_loss_terms(lp, torch.zeros(4), old, adv, clip_low=0.2, clip_high=0.28, seq_log_ratio=slr)
    # every token carries its sequence's ratio (token ratios 1.2 and 1.875 are not used)
    torch.testing.assert_close(t["ratio"].detach(), torch.tensor([1.5, 1.5, 0.5, 0.5]))
    # sequence 0 (A > 0) clipped at 1.28; sequence 1: A < 0 clipped at 0.8, A > 0 not clipped (pessimism)
    torch.testing.assert_close(t["pg"].detach(), torch.tensor([-2 * 1.28, -2 * 1.28, 1 * 0.8, -3 * 0.5]))
    assert t["clip_high"].tolist() == [True, True, False, False]
    assert t["clip_low"].tolist() == [False, False, True, False]
    # the gradient reaches each token through its own log-prob only: d pg_t / d lp_t = -A s (unclipped)
    (g,) = torch.autograd.grad(t["pg"].sum(), lp)
    torch.testing.assert_close(g, torch.tensor([0.0, 0.0, 0.0, -3 * 0.5]))


def test_policy_terms_is_weights_by_hand():
    lp = torch.zeros(3, requires_grad=True)
    old = torch.log(torch.tensor([1 / 1.1, 1 / 1.5, 1.0]))  # ratios 1.1, 1.5, 1.0
    adv = torch.tensor([1.0, 1.0, -2.0])
    ent = torch.tensor([1.0, 2.0, 3.0])
    w = torch.tensor([0.5, 2.0, 0.0])
    t = policy_loss_terms(lp, ent, old, adv, clip_low=0.2, clip_high=0.28, entropy_coef=0.1, is_weights=w)
    # the weight multiplies the policy-gradient term only, not the entropy bonus
    torch.testing.assert_close(t["pg"].detach(), torch.tensor([-1.1 * 0.5, -1.28 * 2.0, 0.0]))
    torch.testing.assert_close(t["loss"].detach(), t["pg"].detach() - 0.1 * ent)
    (g,) = torch.autograd.grad(t["pg"].sum(), lp)
    torch.testing.assert_close(g, torch.tensor([-1.1 * 0.5, 0.0, 0.0]))


def _gspo_by_hand(hidden, weight, targets, old, adv_seq, mask, sid, clip_low, clip_high, temperature):
    """GSPO's objective written plainly (arXiv 2507.18071, no stop-gradient):
    mean over sequences of max(-A s, -A clip(s)), s = exp(mean_t log ratio)."""
    lp, _ = reference_logprob_entropy(hidden, weight, targets, temperature)
    seqs = torch.unique(sid[mask > 0])
    loss = 0.0
    for i in seqs.tolist():
        sel = (sid == i) & (mask > 0)
        s = torch.exp((lp[sel] - old[sel]).mean())
        a = adv_seq[i]
        loss = loss + torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high))
    return loss / len(seqs)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_gspo_equals_the_sequence_objective_by_hand(impl):
    n = 42
    hidden, weight, targets = _data(n, 12, 61, dtype=torch.float64, seed=21, scale=2.0)
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.7)
    sid = torch.arange(n) // 6  # 7 sequences
    # per-sequence shifts put some sequences past each clip bound
    shift = torch.tensor([0.5, -0.5, 0.02, -0.02, 0.3, -0.4, 0.0], dtype=torch.float64)
    old = lp - shift[sid] + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    adv_seq = torch.tensor([1.0, -1.0, 0.5, -2.0, -1.0, 1.0, 0.7], dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.bool)
    mask[[4, 13, 30]] = False
    hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = _gspo_by_hand(hh, ww, targets, old, adv_seq, mask, sid, 0.2, 0.28, 0.7)
    want.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = linear_policy_loss(h2, w2, targets, old, adv_seq[sid], mask, clip_low=0.2, clip_high=0.28,
                             temperature=0.7, loss_agg="seq-mean-token-mean", seq_ids=sid,
                             ratio_level="sequence", impl=impl, chunk_size=8)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(h2.grad, hh.grad, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(w2.grad, ww.grad, atol=1e-7, rtol=1e-5)
    assert bool((h2.grad[~mask] == 0).all())
    # some sequences clipped high and low, whole sequences at once
    assert out.metrics["clipfrac_high"] > 0 and out.metrics["clipfrac_low"] > 0
    # the token-level ratio (PPO) gives another gradient
    h3 = hidden.clone().requires_grad_(True)
    linear_policy_loss(h3, weight, targets, old, adv_seq[sid], mask, clip_low=0.2, clip_high=0.28, temperature=0.7,
                       loss_agg="seq-mean-token-mean", seq_ids=sid, impl=impl).loss.backward()
    assert (h3.grad - h2.grad).norm() > 0.02 * h2.grad.norm()


def test_sequence_ratio_and_is_weights_chunked_match_reference():
    n, h, v = 300, 32, 1001
    hidden, weight, targets = _data(n, h, v, seed=23, scale=2.0)
    g = torch.Generator().manual_seed(24)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.7)
    sid = torch.arange(n) // 23
    old = lp + 0.3 * torch.randn(n, generator=g) + 0.2 * torch.randn(int(sid.max()) + 1, generator=g)[sid]
    adv = torch.randn(n, generator=g)  # per-token advantages (GAE): GSPO-token's general form
    ref = lp + 0.3 * torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    isw = torch.where(mask, torch.rand(n, generator=g) * 2, torch.full((n,), math.nan))  # NaN where masked out
    for ratio_level in ("token", "sequence"):
        kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.001, kl_coef=0.05, temperature=0.7,
                  loss_agg="seq-mean-token-mean", seq_ids=sid, ratio_level=ratio_level, is_weights=isw)
        outs, grads = {}, {}
        for impl in ("reference", "chunked"):
            hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            outs[impl] = linear_policy_loss(hh, ww, targets, old, adv, mask, ref, impl=impl, chunk_size=64, **kw)
            outs[impl].loss.backward()
            grads[impl] = (hh.grad, ww.grad)
        a, b = outs["chunked"], outs["reference"]
        torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-5)
        for x, y in zip(grads["chunked"], grads["reference"]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-4)
        for k, val in b.metrics.items():
            assert a.metrics[k] == pytest.approx(val, abs=1e-5, rel=1e-4), (ratio_level, k)
        assert torch.isfinite(a.loss) and a.metrics["clipfrac"] > 0
        # the grad-free evaluation (the one-pass path) gives the same loss
        with torch.no_grad():
            c = linear_policy_loss(hidden, weight, targets, old, adv, mask, ref, impl="chunked", **kw)
        torch.testing.assert_close(c.loss, a.loss.detach(), atol=1e-6, rtol=1e-6)


def test_unit_is_weights_change_nothing():
    n = 50
    hidden, weight, targets = _data(n, 16, 97, seed=25, scale=2.0)
    g = torch.Generator().manual_seed(26)
    old, adv = -torch.rand(n, generator=g) - 4.0, torch.randn(n, generator=g)
    mask, sid = torch.ones(n, dtype=torch.bool), torch.arange(n) // 10
    for impl in ("reference", "chunked"):
        res = []
        for w in (None, torch.ones(n)):
            hh = hidden.clone().requires_grad_(True)
            out = linear_policy_loss(hh, weight, targets, old, adv, mask, clip_high=0.28, entropy_coef=0.01,
                                     loss_agg="seq-mean-token-mean", seq_ids=sid, is_weights=w, impl=impl)
            out.loss.backward()
            res.append((out.loss, hh.grad, out.metrics))
        assert res[0][0].item() == res[1][0].item() and torch.equal(res[0][1], res[1][1]) and res[0][2] == res[1][2]


def test_sequence_ratio_and_is_weights_bad_inputs():
    hidden, weight, targets = _data(4, 8, 10)
    z, sid = torch.zeros(4), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="'seq'"):
        linear_policy_loss(hidden, weight, targets, z, z, z, ratio_level="seq", seq_ids=sid)
    with pytest.raises(ValueError, match="ratio_level='sequence'.*seq_ids"):
        linear_policy_loss(hidden, weight, targets, z, z, torch.ones(4), ratio_level="sequence")
    with pytest.raises(ValueError, match="is_weights.*-1.0 at index 2"):
        linear_policy_loss(hidden, weight, targets, z, z, torch.ones(4), is_weights=torch.tensor([1, 1, -1.0, 1]))
    with pytest.raises(ValueError, match="is_weights.*nan"):
        linear_policy_loss(hidden, weight, targets, z, z, torch.ones(4), is_weights=torch.tensor([math.nan, 1, 1, 1]))
    with pytest.raises(ValueError, match="is_weights must have shape"):
        linear_policy_loss(hidden, weight, targets, z, z, torch.ones(4), is_weights=torch.ones(3))
    with pytest.raises(TypeError, match="is_weights must be a float"):
        linear_policy_loss(hidden, weight, targets, z, z, torch.ones(4), is_weights=torch.ones(4, dtype=torch.long))
    # anything where the mask is 0
    out = linear_policy_loss(hidden, weight, targets, z, z, torch.tensor([1, 1, 0, 1]),
                             is_weights=torch.tensor([1, 1, math.nan, 1]))
    assert torch.isfinite(out.loss)


def test_policy_loss_settings_checked_when_built():
    """clip_high < clip_low (and any other bad setting) is refused when the settings object is
    built, with one line naming the values, not later inside a loss."""
    with pytest.raises(ValueError) as e:
        PolicyLossSettings(clip_low=0.3, clip_high=0.2)
    msg = str(e.value)
    assert "clip_high=0.2" in msg and "clip_low=0.3" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="kl_estimator .*'k9'"):
        PolicyLossSettings(kl_estimator="k9")
    with pytest.raises(ValueError, match="dual_clip .*0.5"):
        PolicyLossSettings(dual_clip=0.5)
    PolicyLossSettings(clip_low=0.2, clip_high=0.2)  # equal bounds: plain PPO
    # the keyword form builds the same object: clip_low above the default clip_high is refused too
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    t = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="clip_high=0.2 < clip_low=0.3"):
        linear_policy_loss(hidden, weight, t, torch.zeros(3), torch.ones(3), torch.ones(3), clip_low=0.3)


def test_cispo_as_published_has_no_lower_bound_on_its_is_weight(tmp_path):
    """CISPO (arXiv 2506.13585) clips its IS weight from above only: clip_low >= 1 puts the lower
    bound at or below 0, under every ratio, and clip-higher's clip_high >= clip_low does not apply.
    (The settings check refused clip_low >= 1 for every loss: CISPO as published could not be set.)"""
    from fastpo.config import load_config
    from fastpo.config.fields import ConfigError
    from fastpo.kernels.torch_reference import policy_loss_terms

    s = PolicyLossSettings(loss="cispo", clip_low=1.0, clip_high=0.28)
    lp = torch.log(torch.tensor([0.05, 0.5, 3.0]))  # ratios 0.05, 0.5, 3.0 against old log-probs 0
    out = policy_loss_terms(lp, torch.zeros(3), torch.zeros(3), torch.ones(3), settings=s)
    # weight = sg(min(r, 1 + clip_high)): 0.05 and 0.5 as they are, 3.0 cut to 1.28
    assert out["pg"].tolist() == pytest.approx((-torch.tensor([0.05, 0.5, 1.28]) * lp).tolist(), rel=1e-6)
    assert not bool(out["clip_low"].any()) and out["clip_high"].tolist() == [False, False, True]
    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path}", "algorithm.policy_loss=cispo", "algorithm.clip_low=1.0"])
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (1.0, 0.28)
    with pytest.raises(ValueError, match="clip_low must be < 1"):  # PPO's clip range stays a range
        PolicyLossSettings(loss="ppo", clip_low=1.0, clip_high=1.0)
    with pytest.raises(ConfigError, match="'algorithm.clip_low' = 1.0: must be < 1"):
        load_config(env="bandit", preset="tiny", overrides=[f"trainer.output_dir={tmp_path}", "algorithm.clip_low=1.0",
                                                            "algorithm.clip_high=1.0"])


def test_library_defaults_are_verls():
    """The library's defaults (kept on purpose: a loss moved from verl computes the same
    objective; docs/kernels_compile.md sets them beside the trainer's)."""
    s = PolicyLossSettings()
    assert (s.clip_low, s.clip_high, s.dual_clip, s.entropy_coef, s.kl_coef, s.kl_estimator, s.loss_agg,
            s.ratio_level) == (0.2, 0.2, None, 0.0, 0.0, "k3", "token-mean", "token")
