"""fastpo.kernels' Triton kernels against the reference.

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1
is set here, before fastpo.kernels imports triton: the interpreter is chosen when a kernel
is decorated), at small shapes. Tests marked `gpu` run the compiled kernels at real shapes
and skip without CUDA.

Tolerances: fp32 inputs, log-prob/entropy/gradients within 1e-4 absolute (exact fp32
products, different summation order); bf16 inputs, log-prob/entropy within 1e-4 (fp32
accumulation of exact products) and gradients within 2e-2 relative to their scale (the
dlogits buffer and the returned gradients are bf16).
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from fastpo.kernels import (linear_logprob_entropy, linear_policy_loss, reference_logprob_entropy,  # noqa: E402
                            resolve_impl)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _data(n, h, v, dtype, seed=0, scale=2.0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden.to(device), weight.to(device), targets.to(device)


def _close(x, y, rel, name=""):
    scale = max(1.0, y.abs().max().item())
    err = (x.float() - y.float()).abs().max().item()
    assert err <= rel * scale, f"{name}: max error {err:.3g} > {rel:g} * {scale:.3g}"


@pytest.mark.parametrize("dtype,v,temperature", [(torch.float32, 1000, 0.5), (torch.float32, 997, 1.0),
                                                 (torch.bfloat16, 1000, 1.0), (torch.bfloat16, 130, 0.5)])
def test_forward_matches_reference(dtype, v, temperature):
    hidden, weight, targets = _data(37, 40, v, dtype)
    lp, ent = linear_logprob_entropy(hidden, weight, targets, temperature, impl="triton")
    lr, er = reference_logprob_entropy(hidden, weight, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    assert bool((lp <= 0).all()), "padded vocab columns must count as -inf"
    torch.testing.assert_close(lp, lr, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent, er, atol=1e-4, rtol=1e-5)


def test_all_negative_logits():
    hidden, weight, targets = _data(20, 31, 301, torch.float32, seed=1)
    ones = torch.ones(20, 1, device=DEV)
    h = torch.cat([hidden, ones], 1)
    w = torch.cat([weight, torch.full((301, 1), -50.0, device=DEV)], 1)  # every logit shifted by -50
    lp, ent = linear_logprob_entropy(h, w, targets, impl="triton")
    lr, er = reference_logprob_entropy(hidden.double(), weight.double(), targets)
    torch.testing.assert_close(lp.double(), lr, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent.double(), er, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_reference(dtype):
    n, v = 40, 1000
    hidden, weight, targets = _data(n, 48, v, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    grads = {}
    for impl in ("triton", "reference"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = linear_logprob_entropy(hh, ww, targets, 0.5, impl=impl)
        (lp * g_lp + ent * g_ent).sum().backward()
        assert hh.grad.dtype == ww.grad.dtype == dtype
        grads[impl] = (hh.grad, ww.grad)
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    _close(grads["triton"][0], grads["reference"][0], rel, "d hidden")
    _close(grads["triton"][1], grads["reference"][1], rel, "d weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_matches_reference(dtype):
    n, v = 48, 777
    hidden, weight, targets = _data(n, 40, v, dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.5)
    old = lp + 0.3 * torch.randn(n, generator=g).to(DEV)
    ref = lp + 0.3 * torch.randn(n, generator=g).to(DEV)
    adv = torch.randn(n, generator=g).to(DEV)
    mask = (torch.arange(n) % 4 != 1).to(DEV)
    sid = (torch.arange(n) // 10).to(DEV)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.01, kl_coef=0.1, temperature=0.5,
              loss_agg="seq-mean-token-mean", seq_ids=sid)
    res = {}
    for impl in ("triton", "reference"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, ref, impl=impl, **kw)
        out.loss.backward()
        res[impl] = (out, hh.grad, ww.grad)
    (a, ah, aw), (b, bh, bw) = res["triton"], res["reference"]
    torch.testing.assert_close(a.loss, b.loss.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.logprob, b.logprob.float(), atol=1e-4, rtol=1e-5)
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    _close(ah, bh, rel, "d hidden")
    _close(aw, bw, rel, "d weight")
    assert bool((ah[~mask] == 0).all()), "masked tokens must get exactly zero gradient"
    for k in ("clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean", "entropy", "kl"):
        assert a.metrics[k] == pytest.approx(b.metrics[k], abs=1e-4), k
    assert a.metrics["clipfrac"] > 0


def test_on_policy_ratio_exactly_one():
    hidden, weight, targets = _data(33, 32, 500, torch.float32, seed=6)
    with torch.no_grad():
        old, _ = linear_logprob_entropy(hidden, weight, targets, 0.5, impl="triton")
    out = linear_policy_loss(hidden.requires_grad_(True), weight, targets, old, torch.randn(33, device=DEV),
                             torch.ones(33, device=DEV), temperature=0.5, impl="triton")
    assert out.metrics["ratio_min"] == 1.0 and out.metrics["ratio_max"] == 1.0 and out.metrics["clipfrac"] == 0.0


def test_entropy_gradient_finite_with_underflowing_probabilities():
    hidden, weight, targets = _data(16, 24, 100, torch.float32, seed=10, scale=300.0)
    hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = linear_logprob_entropy(hh, ww, targets, impl="triton")
    (ent.sum() + lp.sum()).backward()
    assert torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all()
    assert bool((lp <= 0).all()) and bool((ent >= 0).all())


def test_causal_lm_adapter_on_the_triton_path():
    import transformers

    from fastpo.kernels import causal_lm_policy_loss

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=203, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().to(DEV)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 203, (2, 12), generator=g).to(DEV)
    mask = torch.ones(2, 12, device=DEV)
    mask[:, :4] = 0
    old = -5.0 + 0.1 * torch.randn(2, 12, generator=g).to(DEV)
    adv = torch.randn(2, 12, generator=g).to(DEV)
    grads = {}
    for impl in ("triton", "chunked"):
        model.zero_grad()
        out = causal_lm_policy_loss(model, ids, old, adv, mask, impl=impl, entropy_coef=0.01, temperature=0.5)
        out.loss.backward()
        grads[impl] = (out.loss.detach(), out.logprob, [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads["triton"][0], grads["chunked"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads["triton"][1], grads["chunked"][1], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads["triton"][2], grads["chunked"][2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_dispatcher():
    dev = torch.device(DEV)
    assert resolve_impl("auto", torch.device("cpu")) == "chunked"
    assert resolve_impl("triton", dev) == "triton"
    if CUDA:
        assert resolve_impl("auto", dev) == "triton"
    with pytest.raises(ValueError, match="'cuda'"):
        resolve_impl("cuda", dev)


# ---- compiled kernels at real shapes (H100/H200) ----

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,n,h,v", [(torch.bfloat16, 4096, 896, 151936), (torch.float32, 1000, 576, 49152)])
def test_gpu_real_shapes_match_reference(dtype, n, h, v):
    hidden, weight, targets = _data(n, h, v, dtype, seed=7, scale=1.0)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        lp0, _ = reference_logprob_entropy(hidden, weight, targets)
    old = lp0 + 0.2 * torch.randn(n, generator=g).cuda()
    adv = torch.randn(n, generator=g).cuda()
    mask = torch.rand(n, generator=g).cuda() > 0.2
    kw = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.001)
    res = {}
    for impl in ("triton", "reference"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, impl=impl, **kw)
        out.loss.backward()
        res[impl] = (out, hh.grad, ww.grad)
        del hh, ww
        torch.cuda.empty_cache()
    (a, ah, aw), (b, bh, bw) = res["triton"], res["reference"]
    torch.testing.assert_close(a.logprob, b.logprob, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(a.entropy, b.entropy, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-4, rtol=1e-4)
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    _close(ah, bh, rel, "d hidden")
    _close(aw, bw, rel, "d weight")
    assert bool((ah[~mask] == 0).all())


@gpu
@pytest.mark.gpu
def test_gpu_logprob_independent_of_batch_composition():
    hidden, weight, targets = _data(3000, 896, 151936, torch.bfloat16, seed=9, scale=1.0)
    with torch.no_grad():
        lp_all, ent_all = linear_logprob_entropy(hidden, weight, targets)
        lp_sub, ent_sub = linear_logprob_entropy(hidden[1000:1777], weight, targets[1000:1777])
    assert torch.equal(lp_all[1000:1777], lp_sub) and torch.equal(ent_all[1000:1777], ent_sub)
