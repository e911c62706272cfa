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
the returned gradients are bf16). Gradients of a token-mean loss are far below 1, so the
newer tests scale by the reference's own largest entry (`_rel_close`) and also bound the
error's norm. The many-tile d weight check compares each entry's error with the sum of the
absolute contributions to it: 1e-5 (fp32; 1e-4 on the GPU) and 1e-2 (bf16: two roundings
of at most 2^-8 each, dlogits and the result).

Under the interpreter an fp16 tl.dot is slow (numpy's matmul without BLAS: ~15 ms per
128x64x128 product), so the tests at the compiled kernels' tile sizes (`gpu_blocks`) keep
to one or two row blocks and a few hundred tiles at most.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastpo.kernels import (PolicyLossSettings, linear_logprob_entropy, linear_policy_loss,  # noqa: E402
                            reference_logprob_entropy, resolve_impl)
from fastpo.kernels._triton import _grouped_ids  # noqa: E402
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


def _rel_close(x, y, rel, name=""):
    """Max error within rel * max|y| and the error's norm within rel * |y| (whatever y's scale)."""
    x, y = x.float(), y.float()
    scale = y.abs().max().item()
    assert scale > 0, f"{name}: the reference is all zeros"
    err = (x - y).abs().max().item()
    assert err <= rel * scale, f"{name}: max error {err:.3g} > {rel:g} * {scale:.3g}"
    nerr = ((x - y).norm() / y.norm()).item()
    assert nerr <= rel, f"{name}: relative error norm {nerr:.3g} > {rel:g}"


@pytest.fixture
def gpu_blocks(monkeypatch):
    """The compiled kernels' tile sizes under the interpreter too (half precision: BLOCK_N =
    BLOCK_V = 128, BLOCK_D = 64, 16 tiles per vocabulary split); on CUDA they are the default."""
    from fastpo.kernels import _triton

    monkeypatch.setattr(_triton, "INTERPRET_BLOCKS", "gpu")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sequence_ratio_and_is_weights_match_reference(dtype):
    """GSPO's sequence ratio (ratio_level="sequence") and importance-sampling weights: the
    Triton path equals the reference and the chunked path (fp16 runs the production tl.dot
    branch under the interpreter; bf16's interpreter dot is wrong, see the module docstring)."""
    n, v = 40, 301
    hidden, weight, targets = _data(n, 32, v, dtype, seed=31)
    g = torch.Generator().manual_seed(32)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.7)
    sid = (torch.arange(n) // 8).to(DEV)
    shift = torch.tensor([0.4, -0.4, 0.0, 0.1, -0.1]).to(DEV)
    old = lp - shift[sid] + 0.1 * torch.randn(n, generator=g).to(DEV)
    adv = torch.randn(n, generator=g).to(DEV)
    mask = (torch.arange(n) % 7 != 3).to(DEV)
    isw = (torch.rand(n, generator=g) * 2).to(DEV)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.01, temperature=0.7,
              loss_agg="seq-mean-token-mean", seq_ids=sid, ratio_level="sequence", is_weights=isw)
    b = _paths_agree(hidden, weight, targets, old, adv, mask, kw, dtype,
                     ("clipfrac", "clipfrac_low", "clipfrac_high", "ratio_mean", "ratio_max", "pg_loss"))
    assert b.metrics["clipfrac_high"] > 0 and b.metrics["clipfrac_low"] > 0


def _paths_agree(hidden, weight, targets, old, adv, mask, kw: dict, dtype, metrics=None):
    """The Triton and chunked paths against the reference for `linear_policy_loss(..., **kw)`:
    loss, gradients (GRAD_REL), exact zeros on masked rows, and `metrics` (all by default).
    Returns the reference's output."""
    res = {}
    for impl in ("triton", "chunked", "reference"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, impl=impl, **kw)
        out.loss.backward()
        res[impl] = (out, hh.grad, ww.grad)
    b, bh, bw = res["reference"]
    for impl in ("triton", "chunked"):
        a, ah, aw = res[impl]
        torch.testing.assert_close(a.loss, b.loss.float(), atol=1e-4, rtol=1e-4)
        _close(ah, bh, GRAD_REL[dtype], f"{impl} d hidden")
        _close(aw, bw, GRAD_REL[dtype], f"{impl} d weight")
        assert bool((ah[~mask] == 0).all()), impl
        for k in (metrics or b.metrics):
            assert a.metrics[k] == pytest.approx(b.metrics[k], abs=1e-4), (impl, k)
    return b


@pytest.mark.parametrize("loss,dtype", [("cispo", torch.float32), ("sapo", torch.float32), ("clip_cov", torch.float32),
                                        ("kl_cov", torch.float32), ("cispo", torch.float16), ("kl_cov", torch.float16)])
def test_loss_menu_matches_reference(loss, dtype):
    """CISPO, SAPO, Clip-Cov and KL-Cov (issue 35) on the Triton path: equal to the reference
    and the chunked path, forward, metrics and gradients, with IS weights."""
    n, v = 40, 301
    hidden, weight, targets = _data(n, 32, v, dtype, seed=33)
    g = torch.Generator().manual_seed(34)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.7)
    old = lp + 0.3 * torch.randn(n, generator=g).to(DEV)
    adv = torch.randn(n, generator=g).to(DEV)
    mask = (torch.arange(n) % 7 != 3).to(DEV)
    isw = (torch.rand(n, generator=g) * 2).to(DEV)
    sid = (torch.arange(n) // 8).to(DEV)
    own = {"cispo": dict(clip_low=0.2, clip_high=0.28), "sapo": dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05),
           "clip_cov": dict(cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=50.0), "kl_cov": dict(cov_ratio=0.1)}[loss]
    settings = PolicyLossSettings(entropy_coef=0.01, temperature=0.7, loss_agg="seq-mean-token-mean", loss=loss, **own)
    b = _paths_agree(hidden, weight, targets, old, adv, mask, dict(seq_ids=sid, is_weights=isw, settings=settings),
                     dtype)
    assert b.metrics["covfrac"] > 0 if loss in ("clip_cov", "kl_cov") else "covfrac" not in b.metrics


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


# ---- the production configuration under the interpreter: GPU tile sizes, fp16 tl.dot ----

def _policy_case(n, h, v, dtype, seed=30, shift=None, device=DEV):
    """Inputs of a policy-loss comparison (the paper's loss: clip-higher, entropy bonus,
    seq-mean-token-mean over 37-token sequences, 20% of the tokens masked). shift: every
    logit moved by -shift (last hidden unit 1, its weight column -shift; the softmax is
    unchanged), so that a padded vocabulary column counted as logit 0 instead of -inf would
    outweigh the whole real vocabulary."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device)
    weight = torch.randn(v, h, generator=g, device=device) / math.sqrt(h)
    if shift is not None:
        hidden[:, -1] = 1.0
        weight[:, -1] = -shift
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    with torch.no_grad():
        lp, _ = linear_logprob_entropy(hidden, weight, targets, impl="chunked")
    old = lp + 0.2 * torch.randn(n, generator=g, device=device)
    adv = torch.randn(n, generator=g, device=device)
    mask = torch.rand(n, generator=g, device=device) > 0.2
    sid = torch.arange(n, device=device) // 37
    return hidden, weight, targets, old, adv, mask, sid


LOSS_KW = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.001, loss_agg="seq-mean-token-mean")


def _loss_and_grads(impl, case, temperature):
    hidden, weight, targets, old, adv, mask, sid = case
    hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = linear_policy_loss(hh, ww, targets, old, adv, mask, seq_ids=sid, temperature=temperature, impl=impl,
                             **LOSS_KW)
    out.loss.backward()
    return out, hh.grad, ww.grad


def _check_loss_against(res, base, mask, grad_rel, atol=1e-4, shifted=False):
    """Log-prob, entropy, loss, both gradients and the metrics of `res` against `base`.
    shifted (a `_policy_case` with shift): d hidden of the constant last unit is -shift times
    the sum of the token's dlogits, exactly 0 but for rounding, which bf16 dlogits amplify by
    the shift: that column is left out of the d hidden comparison."""
    (a, ah, aw), (b, bh, bw) = res, base
    assert bool((a.logprob <= 0).all()), "padded vocab columns must count as -inf"
    torch.testing.assert_close(a.logprob, b.logprob.float(), atol=atol, rtol=1e-5)
    torch.testing.assert_close(a.entropy, b.entropy.float(), atol=atol, rtol=1e-5)
    torch.testing.assert_close(a.loss, b.loss.float(), atol=1e-5, rtol=1e-4)
    cols = slice(0, -1) if shifted else slice(None)
    _rel_close(ah[:, cols], bh[:, cols], grad_rel, "d hidden")
    _rel_close(aw, bw, grad_rel, "d weight")
    assert bool((ah[~mask] == 0).all()), "masked tokens must get exactly zero gradient"
    for k in ("approx_kl", "ratio_mean", "entropy", "pg_loss"):
        assert a.metrics[k] == pytest.approx(b.metrics[k], abs=1e-4), k


@pytest.mark.parametrize("v,n,h,temperature,shift", [
    (50257, 100, 64, 1.0, 20.0),  # 393 tiles in 25 splits, 47 padded columns; every logit near -20
    (2049, 136, 80, 0.25, None),  # 2 splits, the last a single tile with one real column; partial row/D blocks
    (100, 136, 80, 0.1, None),  # a single tile, 28 padded columns; very low temperature
])
def test_gpu_blocks_fp16_odd_vocab_matches_reference(gpu_blocks, v, n, h, temperature, shift):
    """The half-precision production branch (tl.dot on fp16 tiles) at the compiled tile sizes.
    At V=50257 with logits near -20, padded columns counted as 0 would move log-probs by ~12."""
    from fastpo.kernels import _triton

    cfg = _triton._config(torch.float16)
    assert (cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["BLOCK_D"], cfg["IEEE"]) == (128, 128, 64, False)
    case = _policy_case(n, h, v, torch.float16, shift=shift)
    res, base = (_loss_and_grads(impl, case, temperature) for impl in ("triton", "reference"))
    _check_loss_against(res, base, case[5], GRAD_REL[torch.float16], shifted=shift is not None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_blocks_other_dtypes_match_reference(gpu_blocks, dtype):
    """bf16 and fp32 at their compiled tile sizes (under the interpreter the bf16 dot runs in
    fp32; the tile sizes, splits and the bf16 dlogits buffer are the production ones)."""
    case = _policy_case(136, 80, 2049, dtype, shift=20.0, seed=31)
    res, base = (_loss_and_grads(impl, case, 0.5) for impl in ("triton", "reference"))
    _check_loss_against(res, base, case[5], GRAD_REL[dtype], shifted=True)


def test_gpu_blocks_logprob_independent_of_batch_composition(gpu_blocks):
    """A token's log-prob and entropy are bitwise the same whatever batch it comes in (ratio
    exactly 1 on policy): another number of row blocks and of row-block groups, the same
    vocabulary splits. Under the interpreter numpy's matmul may round a row differently at
    another position inside a tile, so the rows keep theirs here (an offset of whole row
    blocks); `test_gpu_logprob_independent_of_batch_composition` takes any offset."""
    hidden, weight, targets = _data(300, 64, 2049, torch.float16, seed=32)
    with torch.no_grad():
        lp_all, ent_all = linear_logprob_entropy(hidden, weight, targets, impl="triton")
        lp_sub, ent_sub = linear_logprob_entropy(hidden[128:200], weight, targets[128:200], impl="triton")
    assert torch.equal(lp_all[128:200], lp_sub) and torch.equal(ent_all[128:200], ent_sub)


# Paper-scale shapes: (hidden size H, vocabulary V) of the LM heads the trainer is for. On the
# GPU at N=16384 in bf16; under the interpreter at N=128 and H, V divided by 32, in fp16 (the
# tl.dot branch of bf16), through the same comparison.
PAPER_SHAPES = {"qwen2.5-0.5b": (896, 151936), "qwen2.5-7b": (3584, 152064), "llama-3-8b": (4096, 128256)}


def _paper_shape_check(n, h, v, dtype, device, grad_rel):
    """The Triton path against the chunked path: log-prob, entropy, loss, both gradients."""
    case = _policy_case(n, h, v, dtype, seed=33, device=device)
    res = _loss_and_grads("triton", case, 1.0)
    base = _loss_and_grads("chunked", case, 1.0)
    _check_loss_against(res, base, case[5], grad_rel, atol=2e-4)


@pytest.mark.parametrize("shape", list(PAPER_SHAPES))
def test_paper_shapes_reduced_match_chunked(gpu_blocks, shape):
    h, v = PAPER_SHAPES[shape]
    _paper_shape_check(128, h // 32, v // 32, torch.float16, DEV, GRAD_REL[torch.float16])


# ---- program order, autotuning, out-of-memory handling, the probe ----

@triton.jit
def _order_kernel(out_ptr, n_a, n_b, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    a, b = _grouped_ids(pid, n_a, n_b, GROUP)
    tl.store(out_ptr + 2 * pid, a)
    tl.store(out_ptr + 2 * pid + 1, b)


def test_grouped_program_order_visits_every_tile_once():
    """The grouped order maps program ids onto the [row blocks, vocabulary pieces] grid one to
    one (partial last group included), GROUP row blocks per group, row blocks fastest."""
    order = _order_kernel
    for n_a, n_b, group in ((13, 5, 4), (3, 7, 8), (16, 3, 8), (1, 1, 8), (9, 2, 1)):
        out = torch.full((n_a * n_b, 2), -1, dtype=torch.int32, device=DEV)
        order[(n_a * n_b,)](out, n_a, n_b, GROUP=group)
        pairs = [tuple(p) for p in out.cpu().tolist()]
        assert sorted(pairs) == [(a, b) for a in range(n_a) for b in range(n_b)], (n_a, n_b, group)
        for pid, (a, b) in enumerate(pairs):
            assert a // group == pid // (group * n_b), (n_a, n_b, group, pid)  # groups in order
            if pid and a // group == pairs[pid - 1][0] // group:  # inside a group b never goes back:
                assert b >= pairs[pid - 1][1], (n_a, n_b, group, pid)  # row blocks vary fastest


@pytest.mark.skipif(CUDA, reason="the interpreter's stand-in timer; on the GPU autotuning is on by default")
def test_autotuned_launch_under_the_interpreter(monkeypatch):
    """The autotuned wrappers (launch options without the tuned ones, the grid from the chosen
    BLOCK_N) give the reference's results; the forward is tuned per (V, H, dtype) only (one
    config for every batch size), the dlogits kernel per bucket of N too."""
    from fastpo.kernels import _triton

    monkeypatch.setattr(_triton, "AUTOTUNE", True)
    monkeypatch.setattr(_triton, "_tuned", {})
    for n in (40, 300):  # N buckets 256 and 1024
        hidden, weight, targets = _data(n, 24, 300, torch.float32, seed=34)
        g = torch.Generator().manual_seed(35)
        g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
        grads = {}
        for impl in ("triton", "reference"):
            hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            lp, ent = linear_logprob_entropy(hh, ww, targets, 0.5, impl=impl)
            (lp * g_lp + ent * g_ent).sum().backward()
            grads[impl] = (lp, ent, hh.grad, ww.grad)
        for a, b in zip(grads["triton"], grads["reference"]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    fwd, dlogits = _triton._tuned["fwd", True], _triton._tuned["dlogits", True]
    assert len(fwd.cache) == 1 and len(dlogits.cache) == 2, (fwd.cache, dlogits.cache)
    assert [_triton.n_bucket(x) for x in (1, 256, 257, 4096, 16384, 16385, 10**6)] == [
        256, 256, 1024, 4096, 16384, 65536, 65536]


class _OOMAbove:
    """Stands in for a Triton kernel: raises torch's CUDA out-of-memory error for launches over
    more than `limit` rows (forward; argument 4) or vocabulary columns (dlogits; argument 12),
    else launches the real kernel."""

    def __init__(self, kernel, arg, limit):
        self.kernel, self.arg, self.limit, self.fired = kernel, arg, limit, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if args[self.arg] > self.limit:
                self.fired += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_out_of_memory_is_retried_per_call_never_switching_implementation(monkeypatch):
    """An OOM in impl='auto''s Triton path: the call is retried in smaller pieces on Triton
    (bitwise the same log-probs: the on-policy ratio stays exactly 1), one warning names the
    shape, and nothing moves later calls to the chunked path."""
    import warnings

    from fastpo.kernels import _triton, api

    monkeypatch.setattr(api, "resolve_impl", lambda impl, device, dtype=None: "triton")  # auto -> Triton here
    monkeypatch.setattr(api, "_triton_failed", None)
    monkeypatch.setattr(api, "_oom_warned", False)
    n, v = 70, 500
    hidden, weight, targets = _data(n, 32, v, torch.float32, seed=36)
    old, _ = linear_logprob_entropy(hidden, weight, targets, 0.5, impl="auto")  # the old log-probs, no OOM
    fwd = _OOMAbove(_triton._fwd_kernel, 4, 20)  # more than 20 rows per launch: out of memory
    dl = _OOMAbove(_triton._dlogits_kernel, 12, 200)  # more than 200 vocabulary columns per slice
    monkeypatch.setattr(_triton, "_fwd_kernel", fwd)
    monkeypatch.setattr(_triton, "_dlogits_kernel", dl)
    adv = torch.randn(n, generator=torch.Generator().manual_seed(37))
    with pytest.warns(RuntimeWarning, match=rf"out of memory in the Triton forward at N={n}, H=32, V={v}"):
        hh = hidden.clone().requires_grad_(True)
        out = linear_policy_loss(hh, weight, targets, old, adv, torch.ones(n), temperature=0.5, impl="auto")
    out.loss.backward()
    assert fwd.fired >= 1 and dl.fired >= 1
    assert api._triton_failed is None
    assert torch.equal(out.logprob, old), "the retried forward must give bitwise the same log-probs"
    assert out.metrics["ratio_min"] == out.metrics["ratio_max"] == 1.0
    hr = hidden.clone().requires_grad_(True)
    from fastpo.kernels import reference_policy_loss

    loss_r = reference_policy_loss(hr, weight, targets, old, adv, torch.ones(n), temperature=0.5)[0]
    loss_r.backward()
    _rel_close(hh.grad, hr.grad, 1e-5, "d hidden after the retried backward")
    with warnings.catch_warnings():  # warned once: a second OOM retries silently
        warnings.simplefilter("error")
        again, _ = linear_logprob_entropy(hidden, weight, targets, 0.5, impl="auto")
    assert torch.equal(again, old)


def test_out_of_memory_at_the_smallest_pieces_is_raised(monkeypatch):
    from fastpo.kernels import _triton, api

    monkeypatch.setattr(api, "_triton_failed", None)
    monkeypatch.setattr(api, "_oom_warned", True)
    fwd = _OOMAbove(_triton._fwd_kernel, 4, 0)  # no launch fits
    monkeypatch.setattr(_triton, "_fwd_kernel", fwd)
    hidden, weight, targets = _data(40, 16, 100, torch.float32, seed=38)
    for impl in ("triton", "triton-auto"):
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            api._stats(impl, hidden, weight, targets, 1.0, None)
    assert fwd.fired == 2 * (api.OOM_RETRIES + 1) and api._triton_failed is None


def test_half_precision_gemm_retry_order(monkeypatch):
    """mm_f32: an OOM from the fp32-output GEMM is raised (the fp32-copy route would need more
    memory), not taken for a missing feature; a missing feature warns once and uses fp32 copies."""
    from fastpo.kernels import chunked

    a, b = torch.randn(5, 8).to(torch.bfloat16), torch.randn(8, 3).to(torch.bfloat16)
    exact = a.float() @ b.float()
    monkeypatch.setitem(chunked._MM_OUT_DTYPE, "cpu", True)  # pretend this device has out_dtype
    real_mm = torch.mm

    def oom_mm(*args, **kwargs):
        if "out_dtype" in kwargs:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", oom_mm)
    with pytest.raises(torch.OutOfMemoryError):
        chunked.mm_f32(a, b)
    assert chunked._MM_OUT_DTYPE["cpu"] is True
    monkeypatch.setattr(torch, "mm", real_mm)
    with pytest.warns(RuntimeWarning, match="out_dtype=torch.float32. does not work for torch.bfloat16 on cpu"):
        r = chunked.mm_f32(a, b)  # the CPU build has no bf16 x bf16 -> fp32 mm: fp32 copies
    assert r.dtype == torch.float32 and torch.equal(r, exact) and chunked._MM_OUT_DTYPE["cpu"] is False


def test_probe_decides_auto_before_any_result(monkeypatch):
    """impl='auto' runs both kernels once on a tiny problem before it first picks Triton: a
    kernel that fails (or computes a wrong result) moves the run to chunked before any
    log-prob exists; an OOM in the probe decides nothing."""
    from fastpo.kernels import _triton, api

    dev = torch.device(DEV)
    monkeypatch.setattr(api, "_triton_failed", None)
    monkeypatch.setattr(api, "_probed", set())
    assert api._triton_ready(dev, torch.float32) and api._triton_failed is None
    assert (str(dev), torch.float32) in api._probed
    monkeypatch.setattr(api, "_probed", set())
    fwd_real = _triton._fwd_kernel
    monkeypatch.setattr(_triton, "_fwd_kernel", _OOMAbove(fwd_real, 4, 0))
    with pytest.raises(torch.OutOfMemoryError):
        api._triton_ready(dev, torch.float32)
    assert api._triton_failed is None and not api._probed

    class Wrong:  # a miscompiled dlogits kernel: writes nothing
        def __getitem__(self, grid):
            return lambda *a, **k: a[7].zero_()

    monkeypatch.setattr(_triton, "_fwd_kernel", fwd_real)
    monkeypatch.setattr(_triton, "_dlogits_kernel", Wrong())
    with pytest.warns(RuntimeWarning, match="failed their probe .* d hidden differs from the chunked path"):
        assert not api._triton_ready(dev, torch.float32)
    assert api._triton_failed is not None
    assert api.resolve_impl("auto", torch.device("cuda"), torch.bfloat16) == "chunked"


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
    _rel_close(ah, bh, rel, "d hidden")
    _rel_close(aw, bw, rel, "d weight")
    assert bool((ah[~mask] == 0).all())


@gpu
@pytest.mark.gpu
def test_gpu_logprob_independent_of_batch_composition():
    """Bitwise the same log-prob and entropy for a token in a batch of 3000 and of 777 (rows
    at another offset inside their row block, other autotuning buckets of N), on the Triton
    path itself (impl='auto' could have fallen back to chunked earlier in the session)."""
    hidden, weight, targets = _data(3000, 896, 151936, torch.bfloat16, seed=9, scale=1.0)
    with torch.no_grad():
        lp_all, ent_all = linear_logprob_entropy(hidden, weight, targets, impl="triton")
        lp_sub, ent_sub = linear_logprob_entropy(hidden[1000:1777], weight, targets[1000:1777], impl="triton")
    assert torch.equal(lp_all[1000:1777], lp_sub) and torch.equal(ent_all[1000:1777], ent_sub)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("v,shift", [(1000, None), (50257, None), (50257, 20.0)])
def test_gpu_odd_vocab_bf16_matches_reference(v, shift):
    """Vocabulary sizes that are not a multiple of the compiled BLOCK_V (128): the padded
    columns of the last tile and the bf16 tl.dot branch, at T=0.5, with one non-finite
    hidden row under mask 0. shift: every logit moved down by 20 (last hidden unit 1, its
    weight column -20), so that padded columns counted as 0 instead of -inf would move the
    log-probs by ~12, not by the 1.6e-4 they move at logits around 0 (under the tolerance)."""
    n, h = 2048, 896
    hidden, weight, targets = _data(n, h, v, torch.bfloat16, seed=20, scale=1.0)
    if shift is not None:
        hidden[:, -1], weight[:, -1] = 1.0, -shift
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
    cols = slice(0, -1) if shift is not None else slice(None)  # see `_check_loss_against`
    _rel_close(ah[:, cols], bh[:, cols], 2e-2, "d hidden")
    _rel_close(aw, bw, 2e-2, "d weight")
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


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(PAPER_SHAPES))
def test_gpu_paper_shapes_match_chunked(shape):
    """N=16384 tokens at the LM heads of Qwen2.5-0.5B, Qwen2.5-7B and Llama-3-8B in bf16: the
    Triton path against the chunked path (log-prob, entropy, loss, both gradients); the
    reduced form runs under the interpreter (`test_paper_shapes_reduced_match_chunked`)."""
    h, v = PAPER_SHAPES[shape]
    _paper_shape_check(16384, h, v, torch.bfloat16, "cuda", 2e-2)
    torch.cuda.empty_cache()


@gpu
@pytest.mark.gpu
def test_gpu_autotune_off_matches_reference(monkeypatch):
    """FASTPO_TRITON_AUTOTUNE=0: the plain kernels at their fixed configuration."""
    from fastpo.kernels import _triton

    monkeypatch.setattr(_triton, "AUTOTUNE", False)
    case = _policy_case(2048, 896, 50257, torch.bfloat16, seed=40, device="cuda")
    res, base = (_loss_and_grads(impl, case, 0.5) for impl in ("triton", "reference"))
    _check_loss_against(res, base, case[5], 2e-2, atol=2e-4)
    with torch.no_grad():  # one fixed configuration: batch composition changes nothing either
        lp_sub, _ = linear_logprob_entropy(case[0][300:1000], case[1], case[2][300:1000], 0.5, impl="triton")
    assert torch.equal(res[0].logprob[300:1000], lp_sub)


# --- launches under the tensors' device (issue 14) ---------------------------------------

def test_launch_device_enters_the_tensors_cuda_device(monkeypatch):
    """A tensor on cuda:1 makes `launch_device` enter torch.cuda.device(cuda:1) (a fake
    torch.cuda.device records it, so this runs without a second GPU); CPU tensors get no guard."""
    from fastpo.kernels import _triton

    entered = []

    class FakeCudaDevice:
        def __init__(self, device):
            self.device = torch.device(device)

        def __enter__(self):
            entered.append(("enter", self.device))

        def __exit__(self, *exc):
            entered.append(("exit", self.device))
            return False

    monkeypatch.setattr(torch.cuda, "device", FakeCudaDevice)

    class FakeTensor:
        device = torch.device("cuda", 1)

    with _triton.launch_device(FakeTensor()):
        assert entered == [("enter", torch.device("cuda", 1))]
    assert entered[-1] == ("exit", torch.device("cuda", 1))
    entered.clear()
    with _triton.launch_device(torch.zeros(1)):
        pass
    assert entered == []


def test_every_kernel_launch_runs_under_the_hidden_states_device(monkeypatch):
    """triton_stats and triton_grads launch every kernel inside launch_device(hidden)."""
    from fastpo.kernels import _triton

    active, launches, guarded = [], [], []
    real_guard = _triton.launch_device

    class Guard:
        def __init__(self, t):
            self.t = t

        def __enter__(self):
            guarded.append(self.t.device)
            active.append(self.t.device)
            return real_guard(self.t).__enter__()

        def __exit__(self, *exc):
            active.pop()
            return False

    class Spy:  # kernel[grid](...) records the device guard active at the launch
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*a, **k):
                launches.append(list(active))
                return self.kernel[grid](*a, **k)
            return launch

    real_kernel = _triton._kernel
    monkeypatch.setattr(_triton, "launch_device", Guard)
    monkeypatch.setattr(_triton, "_kernel", lambda *a, **k: Spy(real_kernel(*a, **k)))
    monkeypatch.setattr(_triton, "_combine_kernel", Spy(_triton._combine_kernel))
    hidden, weight, targets = _data(24, 32, 300, torch.float32)
    lp, ent, lse = _triton.triton_stats(hidden, weight, targets, 0.7, max_rows=16, tuned=False)
    g = torch.ones_like(lp)
    _triton.triton_grads(hidden, weight, targets, lse, ent, g, g, 0.7, chunk_bytes=24 * 4 * 128, tuned=False)
    assert len(launches) >= 6  # 2 row chunks x (forward + combine), 2+ vocabulary slices
    assert all(stack == [hidden.device] for stack in launches), launches
    assert guarded == [hidden.device, hidden.device] and active == []


@pytest.mark.parametrize("h,n", [(40, 24), (48, 24), (64, 19), (32, 5)])
def test_the_kernels_get_only_the_aligned_variant(monkeypatch, h, n):
    """Whatever the hidden size and however the inputs are viewed (a buffer 4 bytes into its
    storage, targets one int64 in), every kernel launch gets 16-byte-aligned pointers and a
    hidden size and row strides divisible by 16: the variant bench/kernel_compile.py checks
    for spills. The results are the reference's, gradients cut back to the caller's H."""
    from fastpo.kernels import _triton

    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*a, **k):
                seen.append([x.data_ptr() % 16 if torch.is_tensor(x) else x for x in a])
                return self.kernel[grid](*a, **k)
            return launch

    real_kernel = _triton._kernel
    monkeypatch.setattr(_triton, "_kernel", lambda *a, **k: Spy(real_kernel(*a, **k)))
    v = 300
    hidden, weight, targets = _data(n, h, v, torch.float32)
    shifted = torch.zeros(1 + n * h, device=DEV)[1:].view(n, h)  # contiguous, 4 bytes off alignment
    shifted.copy_(hidden)
    tgt = torch.cat([targets[:1], targets])[1:]  # one int64 in
    assert shifted.data_ptr() % 16 and tgt.data_ptr() % 16
    strided = torch.zeros(v, h + 8, device=DEV)[:, :h]  # rows 8 floats apart from the next
    strided.copy_(weight)
    lp, ent, lse = _triton.triton_stats(shifted, strided, tgt, 0.7, tuned=False)
    g = torch.ones_like(lp)  # lse / ent: rows of one [3, N] buffer, off alignment unless N % 4 == 0
    dh, dw = _triton.triton_grads(shifted, strided, tgt, lse, ent, g, g, 0.7, tuned=False)
    fwd, bwd = seen[0], seen[1]
    # forward: hidden, weight, targets, out, rows, V, H, hidden stride, weight stride, ...
    assert fwd[:4] == [0, 0, 0, 0] and fwd[6] % 16 == 0 and fwd[7] % 16 == 0 and fwd[8] % 16 == 0
    # dlogits: hidden, weight, targets, lse, entropy, g_lp, g_ent, buf, n, V, H, v0, vl, 3 strides
    assert bwd[:8] == [0] * 8 and bwd[10] % 16 == 0 and all(x % 16 == 0 for x in bwd[13:16])
    lr, er = reference_logprob_entropy(hidden, weight, targets, 0.7)
    torch.testing.assert_close(lp, lr, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent, er, atol=1e-4, rtol=1e-5)
    hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lr, er = reference_logprob_entropy(hh, ww, targets, 0.7)
    (lr + er).sum().backward()
    assert dh.shape == (n, h) and dw.shape == (v, h)
    _close(dh, hh.grad, 1e-5, "d hidden")
    _close(dw, ww.grad, 1e-5, "d weight")


def test_triton_path_refuses_tensors_on_two_devices():
    from fastpo.kernels import _triton

    hidden, weight, targets = _data(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="one device.*meta"):
        _triton.triton_stats(hidden, weight.to("meta"), targets, tuned=False)
