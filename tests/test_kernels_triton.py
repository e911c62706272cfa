"""fastpo.kernels' Triton kernels against the reference.

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1
is set here, before fastpo.kernels imports triton: the interpreter is chosen when a kernel
is decorated), at small shapes. Tests marked `gpu` run the compiled kernels at real shapes
and skip without CUDA.

Under the interpreter bf16 tiles are multiplied in fp32 (its bf16 tl.dot is broken, see
`_triton._config`); fp16 runs the production branch (tl.dot on half-precision tiles).

Tolerances (the error's max over all entries, relative to max(1, the reference's largest
entry) unless said otherwise): log-prob and entropy within 1e-4 absolute plus 1e-5 relative
for every dtype (fp32 accumulation of exact products); gradients within 1e-5 for fp32,
2e-3 for fp16 (fp16 gradients, fp32 dlogits) and 2e-2 for bf16 (the dlogits buffer and
the returned gradients are bf16). The many-tile d weight check compares each entry's error
with the sum of the absolute contributions to it: 1e-5 (fp32; 1e-4 on the GPU) and 1e-2
(bf16: two roundings of at most 2^-8 each, dlogits and the result).
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
from test_kernels_reference import accumulation_error, fp64_weight_grad, many_tile_case  # noqa: E402

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
                                                 (torch.bfloat16, 1000, 1.0), (torch.bfloat16, 130, 0.5),
                                                 (torch.float16, 1000, 0.5)])
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


GRAD_REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 0.5), (torch.float32, 1.0), (torch.bfloat16, 0.5),
                                               (torch.bfloat16, 1.0), (torch.float16, 0.5)])
def test_backward_matches_reference(dtype, temperature):
    n, v = 40, 1000
    hidden, weight, targets = _data(n, 48, v, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    grads = {}
    for impl in ("triton", "reference"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = linear_logprob_entropy(hh, ww, targets, temperature, impl=impl)
        (lp * g_lp + ent * g_ent).sum().backward()
        assert hh.grad.dtype == ww.grad.dtype == dtype
        grads[impl] = (hh.grad, ww.grad)
    rel = GRAD_REL[dtype]
    _close(grads["triton"][0], grads["reference"][0], rel, "d hidden")
    _close(grads["triton"][1], grads["reference"][1], rel, "d weight")


@pytest.mark.parametrize("dtype,kl_estimator", [(torch.float32, "k3"), (torch.float32, "k1"),
                                                (torch.bfloat16, "k3")])
def test_policy_loss_matches_reference(dtype, kl_estimator):
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
              loss_agg="seq-mean-token-mean", seq_ids=sid, kl_estimator=kl_estimator)
    res = {}
    for impl in ("triton", "reference"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, ref, impl=impl, **kw)
        out.loss.backward()
        res[impl] = (out, hh.grad, ww.grad)
    (a, ah, aw), (b, bh, bw) = res["triton"], res["reference"]
    torch.testing.assert_close(a.loss, b.loss.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.logprob, b.logprob.float(), atol=1e-4, rtol=1e-5)
    rel = GRAD_REL[dtype]
    _close(ah, bh, rel, "d hidden")
    _close(aw, bw, rel, "d weight")
    assert bool((ah[~mask] == 0).all()), "masked tokens must get exactly zero gradient"
    for k in ("clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean", "entropy", "kl"):
        assert a.metrics[k] == pytest.approx(b.metrics[k], abs=1e-4), k
    assert a.metrics["clipfrac"] > 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter, on the NaN row
def test_nonfinite_hidden_row_under_mask_zero():
    n = 20
    hidden, weight, targets = _data(n, 24, 130, torch.float32, seed=11)
    mask = (torch.arange(n) % 5 != 2).to(DEV)
    bad = hidden.clone()
    bad[2], bad[7, 3] = math.nan, math.inf
    g = torch.Generator().manual_seed(12)
    old, adv = (-3.0 - torch.rand(n, generator=g)).to(DEV), torch.randn(n, generator=g).to(DEV)
    res = []
    for h in (hidden, bad):
        hh, ww = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, entropy_coef=0.01, impl="triton")
        out.loss.backward()
        res.append((out, hh.grad, ww.grad))
    (a, ah, aw), (b, bh, bw) = res
    assert torch.isfinite(bw).all() and bool((bh[~mask] == 0).all()) and torch.isfinite(bh).all()
    assert b.loss.item() == a.loss.item()
    torch.testing.assert_close(bw, aw, atol=1e-7, rtol=1e-6)
    for k, val in a.metrics.items():
        assert b.metrics[k] == pytest.approx(val, rel=1e-6, abs=1e-7), k


@pytest.mark.parametrize("dtype,n,tol", [(torch.float32, 512, 1e-5), (torch.bfloat16, 1024, 1e-2)])
def test_weight_gradient_fp32_over_many_row_tiles(dtype, n, tol):
    """Near-equal rows over 32-64 row tiles: a low-precision sum over tokens would drift
    (bf16 partial sums per 16-row tile: 5.2% off at N=1024, against 0.67% here)."""
    hidden, weight, targets, g_lp, g_ent = many_tile_case(n=n)
    hidden, weight = hidden.to(dtype).to(DEV), weight.to(dtype).to(DEV)
    targets, g_lp, g_ent = targets.to(DEV), g_lp.to(DEV), g_ent.to(DEV)
    ww = weight.clone().requires_grad_(True)
    lp, ent = linear_logprob_entropy(hidden, ww, targets, 0.5, impl="triton")
    (lp * g_lp.float() + ent * g_ent.float()).sum().backward()
    err = accumulation_error(ww.grad, fp64_weight_grad(hidden, weight, targets, g_lp, g_ent, 0.5))
    assert err <= tol, f"d weight off by {err:.3g} of its contributions' size (tolerance {tol:g})"


def test_backward_slices_of_the_vocabulary():
    from fastpo.kernels._triton import (BWD_CHUNK_BYTES, BWD_CHUNK_MIN_BYTES, slice_columns, triton_grads,
                                        triton_stats)

    # the default buffer: 1/8 of the full dlogits at Qwen2.5's N=4096 (not 256 MiB), capped at
    # BWD_CHUNK_BYTES at N=16384, never under 32 MiB; slices even and within the padded V
    cols = slice_columns(4096, 151936, 128, 2)
    assert 4096 * cols * 2 <= 4096 * 151936 * 2 / 8 * 1.01 and cols % 128 == 0
    assert 16384 * slice_columns(16384, 151936, 128, 2) * 2 <= BWD_CHUNK_BYTES
    assert 64 * slice_columns(64, 151936, 128, 2) * 2 >= min(BWD_CHUNK_MIN_BYTES, 64 * 151936 * 2)
    assert slice_columns(40, 1000, 64, 4) == 1024 and slice_columns(40, 1000, 64, 4, chunk_bytes=1) == 64
    assert slice_columns(40, 1000, 64, 4, chunk_bytes=40 * 4 * 400) == 384  # 3 even slices, not 384+384+232
    # several slices give the gradients of one
    n, v = 24, 300
    hidden, weight, targets = _data(n, 16, v, torch.float32, seed=24)
    g = torch.Generator().manual_seed(25)
    g_lp, g_ent = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    _, ent, lse = triton_stats(hidden, weight, targets, 0.5)
    one = triton_grads(hidden, weight, targets, lse, ent, g_lp, g_ent, 0.5)
    many = triton_grads(hidden, weight, targets, lse, ent, g_lp, g_ent, 0.5, chunk_bytes=n * 4 * 128)  # 3 slices
    torch.testing.assert_close(many[0], one[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(many[1], one[1], atol=1e-6, rtol=1e-5)


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

def _triton_and_reference_loss(hidden, weight, targets, old, adv, mask, **kw):
    """(out, d hidden, d weight) of linear_policy_loss on the Triton and the reference path."""
    res = []
    for impl in ("triton", "reference"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, impl=impl, **kw)
        out.loss.backward()
        res.append((out, hh.grad, ww.grad))
        del hh, ww
        torch.cuda.empty_cache()
    return res


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
    (a, ah, aw), (b, bh, bw) = _triton_and_reference_loss(hidden, weight, targets, old, adv, mask, **kw)
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


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("v", [1000, 50257])
def test_gpu_odd_vocab_bf16_matches_reference(v):
    """Vocabulary sizes that are not a multiple of the compiled BLOCK_V (128): the padded
    columns of the last tile and the bf16 tl.dot branch, at T=0.5, with one non-finite
    hidden row under mask 0."""
    n, h = 2048, 896
    hidden, weight, targets = _data(n, h, v, torch.bfloat16, seed=20, scale=1.0)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        lp0, _ = reference_logprob_entropy(hidden, weight, targets, 0.5)
    old = lp0 + 0.2 * torch.randn(n, generator=g).cuda()
    adv = torch.randn(n, generator=g).cuda()
    mask = torch.rand(n, generator=g).cuda() > 0.2
    bad = int((~mask).nonzero()[0, 0])
    hidden[bad] = float("nan")
    kw = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.001, temperature=0.5)
    (a, ah, aw), (b, bh, bw) = _triton_and_reference_loss(hidden, weight, targets, old, adv, mask, **kw)
    ok = torch.isfinite(hidden).all(1)
    assert bool((a.logprob[ok] <= 0).all()), "padded vocab columns must count as -inf"
    torch.testing.assert_close(a.logprob[ok], b.logprob[ok], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(a.entropy[ok], b.entropy[ok], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(aw).all() and bool((ah[~mask] == 0).all())
    _close(ah, bh, 2e-2, "d hidden")
    _close(aw, bw, 2e-2, "d weight")
    assert all(math.isfinite(x) for x in a.metrics.values()), a.metrics
    # clip fractions may differ by a token or two whose ratio sits within 2e-4 of a clip bound
    for k in ("approx_kl", "ratio_mean", "entropy", "pg_loss"):
        assert a.metrics[k] == pytest.approx(b.metrics[k], abs=1e-3), k


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_gpu_weight_gradient_fp32_over_many_row_tiles(dtype, tol):
    """16384 near-equal rows (128+ row tiles, one cuBLAS GEMM over all of them) against an
    fp64 reference, per vocabulary row: a bf16 or TF32 sum over tokens would not pass."""
    hidden, weight, targets, g_lp, g_ent = (x.cuda() for x in many_tile_case(n=16384, h=256, v=1000))
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    ww = weight.clone().requires_grad_(True)
    lp, ent = linear_logprob_entropy(hidden, ww, targets, 0.5, impl="triton")
    (lp * g_lp.float() + ent * g_ent.float()).sum().backward()
    err = accumulation_error(ww.grad, fp64_weight_grad(hidden, weight, targets, g_lp, g_ent, 0.5))
    assert err <= tol, f"d weight off by {err:.3g} of its contributions' size (tolerance {tol:g})"


@gpu
@pytest.mark.gpu
def test_gpu_policy_loss_backward_scales_in_place():
    """The stored [V, H] gradient is scaled in place: no second [V, H] tensor in backward."""
    n, h, v = 1024, 896, 50257
    hidden, weight, targets = _data(n, h, v, torch.bfloat16, seed=22, scale=1.0)
    g = torch.Generator().manual_seed(23)
    old, adv = (-4.0 - torch.rand(n, generator=g)).cuda(), torch.randn(n, generator=g).cuda()
    mask = torch.ones(n, device=DEV)
    grads = []
    for factor in (1.0, 2.0):
        ww = weight.clone().requires_grad_(True)
        out = linear_policy_loss(hidden, ww, targets, old, adv, mask, impl="triton")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        (factor * out.loss).backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - start
        assert extra < ww.numel() * ww.element_size() // 2, f"backward allocated {extra / 2**20:.0f} MiB"
        grads.append(ww.grad)
        del out, ww
    _close(grads[1], 2 * grads[0], 1e-2, "d weight of 2 x loss")  # scaled, not left as is
