"""The policy-loss menu beside PPO's clip (issue 35): CISPO, SAPO, Clip-Cov and KL-Cov.

Each is checked as the PPO losses are: the per-token terms against numbers worked out by
hand, the token choice of the covariance losses by hand, the chunked path against the
reference (fp32 and bf16 inputs, forward, metrics and gradients, every aggregation, with
IS weights), float64 gradcheck, and the one-line errors of settings a loss cannot take.
The Triton path against the reference is in test_kernels_triton.py.
"""
import math

import pytest
import torch

from fastpo.kernels import (POLICY_LOSSES, PolicyLossSettings, linear_policy_loss, policy_loss_terms,
                            reference_logprob_entropy)
from fastpo.kernels.losses import LOSS_AGGS, clip_cov_selection, kl_cov_selection

from kernel_data import lm_head_data as _data

LOG_HALF = math.log(0.5)


def _three_tokens():
    """Three tokens at p = 0.5 whose ratios to the old policy are 2, 1 and 0.5."""
    lp = torch.full((3,), LOG_HALF, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([math.log(0.25), LOG_HALF, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    return lp, old, adv


def test_cispo_terms_by_hand():
    lp, old, adv = _three_tokens()
    t = policy_loss_terms(lp, torch.zeros(3, dtype=torch.float64), old, adv, loss="cispo", clip_low=0.2,
                          clip_high=0.28)
    w = [1.28, 1.0, 0.8]  # clip(2) = 1.28, clip(1) = 1, clip(0.5) = 0.8
    expect = [-a * wi * LOG_HALF for a, wi in zip([1.0, -1.0, 2.0], w)]
    assert t["pg"].tolist() == pytest.approx(expect, abs=1e-12)
    assert t["clip_high"].tolist() == [True, False, False] and t["clip_low"].tolist() == [False, False, True]
    (g,) = torch.autograd.grad(t["loss"].sum(), lp)
    # the IS weight is a constant: every token's gradient is -A * clipped weight, none is zero
    assert g.tolist() == pytest.approx([-1.28, 1.0, -1.6], abs=1e-12)


def test_sapo_terms_by_hand():
    lp, old, adv = _three_tokens()
    t = policy_loss_terms(lp, torch.zeros(3, dtype=torch.float64), old, adv, loss="sapo", sapo_tau_pos=1.0,
                          sapo_tau_neg=1.05)

    def sig(x):
        return 1 / (1 + math.exp(-x))

    taus, ratios, advs = [1.0, 1.05, 1.0], [2.0, 1.0, 0.5], [1.0, -1.0, 2.0]
    gate = [4 / tau * sig(tau * (r - 1)) for tau, r in zip(taus, ratios)]
    assert t["pg"].tolist() == pytest.approx([-a * f for a, f in zip(advs, gate)], abs=1e-12)
    # d pg / d logprob = -A * f'(r) * r with f'(r) = 4 sigmoid (1 - sigmoid): 1 at r = 1 (PPO's gradient)
    slope = [4 * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) * r for tau, r in zip(taus, ratios)]
    (g,) = torch.autograd.grad(t["loss"].sum(), lp)
    assert g.tolist() == pytest.approx([-a * s for a, s in zip(advs, slope)], abs=1e-12)
    assert g[1].item() == pytest.approx(1.0)
    assert not bool(t["clip_low"].any() | t["clip_high"].any() | t["dual_clip"].any())


def _cov_case():
    lp = torch.tensor([-0.1, -2.0, -0.5, -3.0, -1.0, -0.2], dtype=torch.float64)
    adv = torch.tensor([2.0, -1.5, 0.5, 1.0, 0.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
    return lp, adv, mask


def _cov_by_hand(lp, adv, mask):
    keep = [i for i in range(len(lp)) if mask[i]]
    ma = sum(adv[i].item() for i in keep) / len(keep)
    ml = sum(lp[i].item() for i in keep) / len(keep)
    return {i: (adv[i].item() - ma) * (lp[i].item() - ml) for i in keep}


def test_kl_cov_picks_the_largest_covariances_by_hand():
    lp, adv, mask = _cov_case()
    cov = _cov_by_hand(lp, adv, mask)
    s = PolicyLossSettings(loss="kl_cov", cov_ratio=0.5)  # k = floor(0.5 * 5) = 2 of the 5 masked-in tokens
    chosen = kl_cov_selection(lp, lp, adv, mask, s)
    top2 = sorted(cov, key=cov.get, reverse=True)[:2]
    assert torch.nonzero(chosen).reshape(-1).tolist() == sorted(top2)
    assert not chosen[5]  # masked out, whatever its values
    # at least one token, even when the ratio rounds to none
    assert int(kl_cov_selection(lp, lp, adv, mask, PolicyLossSettings(loss="kl_cov", cov_ratio=1e-4)).sum()) == 1
    assert not kl_cov_selection(lp, lp, adv, torch.zeros(6, dtype=torch.bool), s).any()


def test_clip_cov_draws_inside_the_band_outside_ppo_clip_by_hand():
    lp, adv, mask = _cov_case()
    cov = _cov_by_hand(lp, adv, mask)
    old = lp.clone()
    old[0] = lp[0] - 1.0  # token 0: ratio e > 1 + clip_high with A > 0, already clipped by PPO
    lb, ub = 0.05, 2.5
    band = {i for i, c in cov.items() if lb < c < ub and i != 0}
    assert len(band) >= 2 and cov[0] > lb  # the case is informative: token 0 would be in the band
    for seed in range(6):
        s = PolicyLossSettings(loss="clip_cov", cov_ratio=0.2, clip_cov_lb=lb, clip_cov_ub=ub, cov_seed=seed)
        chosen = clip_cov_selection(lp, old, adv, mask, s)
        picked = set(torch.nonzero(chosen).reshape(-1).tolist())
        assert len(picked) == 1 and picked <= band
        assert picked == set(torch.nonzero(clip_cov_selection(lp, old, adv, mask, s)).reshape(-1).tolist())
    # the draw follows the seed: over a few seeds more than one token is picked
    picks = {tuple(torch.nonzero(clip_cov_selection(lp, old, adv, mask, PolicyLossSettings(
        loss="clip_cov", cov_ratio=0.2, clip_cov_lb=lb, clip_cov_ub=ub, cov_seed=seed))).reshape(-1).tolist())
        for seed in range(12)}
    assert len(picks) > 1
    # an empty band chooses nothing
    s = PolicyLossSettings(loss="clip_cov", clip_cov_lb=50.0, clip_cov_ub=60.0)
    assert not clip_cov_selection(lp, old, adv, mask, s).any()


def test_clip_cov_detaches_and_kl_cov_penalises_the_chosen_tokens():
    lp0, adv, mask = _cov_case()
    old = lp0 + torch.tensor([0.05, -0.05, 0.1, -0.1, 0.02, 0.0], dtype=torch.float64)
    chosen = torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.bool)
    ent = torch.zeros(6, dtype=torch.float64)
    lp = lp0.clone().requires_grad_(True)
    ppo = policy_loss_terms(lp, ent, old, adv, clip_low=0.2, clip_high=0.28)
    (g_ppo,) = torch.autograd.grad(ppo["loss"].sum(), lp)
    cc = policy_loss_terms(lp, ent, old, adv, selected=chosen, loss="clip_cov", clip_low=0.2, clip_high=0.28)
    (g_cc,) = torch.autograd.grad(cc["loss"].sum(), lp)
    assert cc["pg"].tolist() == pytest.approx(ppo["pg"].tolist(), abs=0)  # same value
    assert g_cc[chosen].tolist() == [0.0, 0.0] and g_cc[~chosen].tolist() == g_ppo[~chosen].tolist()
    assert cc["covfrac"].tolist() == chosen.tolist()  # the tokens it detached, logged as their share
    kc = policy_loss_terms(lp, ent, old, adv, selected=chosen, loss="kl_cov", kl_cov_coef=2.0)
    (g_kc,) = torch.autograd.grad(kc["loss"].sum(), lp)
    ratio = torch.exp(lp0 - old)
    expect = -adv * ratio + torch.where(chosen, 2.0 * (lp0 - old).abs(), 0.0)  # no clip at all: KL-Cov's pg
    assert kc["pg"].tolist() == pytest.approx(expect.tolist(), abs=1e-12)
    sign = torch.sign(lp0 - old)
    assert g_kc.tolist() == pytest.approx((-adv * ratio + torch.where(chosen, 2.0 * sign, 0.0)).tolist(), abs=1e-12)
    with pytest.raises(ValueError, match="needs selected"):
        policy_loss_terms(lp, ent, old, adv, loss="kl_cov")


def _case(n, dtype, seed):
    hidden, weight, targets = _data(n, 32, 701, dtype=dtype, seed=seed, scale=2.0)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.7)
    old = lp + 0.3 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    isw = torch.where(mask, torch.rand(n, generator=g) * 2, torch.full((n,), math.nan))
    sid = torch.arange(n) // 19
    return hidden, weight, targets, old, adv, mask, isw, sid


LOSS_SETTINGS = {
    "cispo": dict(clip_low=0.2, clip_high=0.28),
    "sapo": dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    # a wide band and a large share, so that the chosen tokens matter at this size
    "clip_cov": dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=50.0,
                     cov_seed=3),
    "kl_cov": dict(cov_ratio=0.05, kl_cov_coef=1.0),
}


@pytest.mark.parametrize("loss", list(LOSS_SETTINGS))
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_reference(loss, loss_agg, dtype):
    hidden, weight, targets, old, adv, mask, isw, sid = _case(230, dtype, seed=41)
    settings = PolicyLossSettings(entropy_coef=0.001, kl_coef=0.05, temperature=0.7, loss_agg=loss_agg, loss=loss,
                                  **LOSS_SETTINGS[loss])
    ref = old + 0.1
    outs, grads = {}, {}
    for impl in ("reference", "chunked"):
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        outs[impl] = linear_policy_loss(hh, ww, targets, old, adv, mask, ref, seq_ids=sid, is_weights=isw,
                                        settings=settings, impl=impl, chunk_size=64)
        outs[impl].loss.backward()
        grads[impl] = (hh.grad, ww.grad)
    a, b = outs["chunked"], outs["reference"]
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(a.loss, b.loss, **tol)
    for x, y in zip(grads["chunked"], grads["reference"]):
        torch.testing.assert_close(x.float(), y.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    for k, val in b.metrics.items():
        assert a.metrics[k] == pytest.approx(val, abs=1e-5, rel=1e-4), k
    if loss in ("clip_cov", "kl_cov"):
        assert 0 < b.metrics["covfrac"] <= 0.06
    else:
        assert "covfrac" not in b.metrics
    assert torch.isfinite(a.loss)
    assert bool((grads["chunked"][0][~mask] == 0).all())
    # the grad-free evaluation (one pass on the chunked path) gives the same loss
    with torch.no_grad():
        c = linear_policy_loss(hidden, weight, targets, old, adv, mask, ref, seq_ids=sid, is_weights=isw,
                               settings=settings, impl="chunked", chunk_size=64)
    torch.testing.assert_close(c.loss, a.loss.detach(), atol=1e-6, rtol=1e-6)


def test_each_loss_changes_the_gradient_and_ppo_is_unchanged():
    """The menu is not PPO under another name: each loss's gradient differs from PPO's on the
    same batch, and loss="ppo" is the default loss bit for bit."""
    hidden, weight, targets, old, adv, mask, _, sid = _case(120, torch.float32, seed=7)
    grads = {}
    for loss in ("default", *POLICY_LOSSES):
        kw = dict(loss=loss, **LOSS_SETTINGS.get(loss, dict(clip_low=0.2, clip_high=0.28)))
        ww = weight.clone().requires_grad_(True)
        given = dict(clip_low=0.2, clip_high=0.28) if loss == "default" else dict(settings=PolicyLossSettings(**kw))
        linear_policy_loss(hidden, ww, targets, old, adv, mask, impl="chunked", **given).loss.backward()
        grads[loss] = ww.grad
    assert torch.equal(grads["default"], grads["ppo"])
    for loss in list(POLICY_LOSSES)[1:]:
        assert not torch.allclose(grads[loss], grads["ppo"], atol=1e-6), loss


@pytest.mark.parametrize("loss", ["cispo", "sapo", "kl_cov"])
def test_gradcheck(loss):
    """Finite differences see the value; a stop-gradient makes the gradient another thing.
    CISPO runs with every ratio outside its clip (its detached weight then constant), and
    Clip-Cov (a detached value on its chosen tokens) is left to the path comparisons."""
    n = 9
    hidden, weight, targets = _data(n, 5, 13, dtype=torch.float64, seed=1)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets, 0.5)
    old = lp + 0.05 + 0.05 * torch.rand(n, generator=g, dtype=torch.float64)  # away from |x|'s and the clips' kinks
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    sid = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
    extra = {"cispo": dict(clip_low=0.01, clip_high=0.01), "kl_cov": dict(cov_ratio=0.3)}
    kw = dict(entropy_coef=0.01, temperature=0.5, loss_agg="seq-mean-token-mean", loss=loss,
              **{**LOSS_SETTINGS[loss], **extra.get(loss, {})})
    settings = PolicyLossSettings(**kw)
    for impl in ("reference", "chunked"):
        def f(h, w):
            return linear_policy_loss(h, w, targets, old, adv, mask, seq_ids=sid, settings=settings, impl=impl,
                                      chunk_size=4).loss
        assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-6, atol=1e-6, fast_mode=True), impl


def test_settings_a_loss_cannot_take_are_refused_in_one_line():
    bad = [
        (dict(loss="grpo"), "loss must be one of"),
        (dict(loss="cispo", dual_clip=3.0), "dual_clip=3.0 applies to PPO's clipped surrogate"),
        (dict(loss="sapo", dual_clip=3.0), "not loss='sapo'"),
        (dict(loss="kl_cov", dual_clip=3.0), "not loss='kl_cov'"),
        (dict(loss="sapo", ratio_level="sequence"), "ratio_level='sequence'"),
        (dict(loss="clip_cov", ratio_level="sequence"), "ratio_level='sequence'"),
        (dict(loss="sapo", sapo_tau_neg=0.0), "sapo_tau_neg must be >= 1.18e-38 .*, got 0.0"),
        (dict(loss="sapo", sapo_tau_pos=math.inf), "sapo_tau_pos must be a finite number, got inf"),
        (dict(loss="kl_cov", cov_ratio=1.5), r"cov_ratio must be in \(0, 1\], got 1.5"),
        (dict(loss="kl_cov", cov_ratio=0.0), "cov_ratio must be"),
        (dict(loss="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), r"clip_cov_lb must be below clip_cov_ub \(1.0\)"),
        (dict(loss="clip_cov", cov_seed=-1), "cov_seed must be an integer >= 0"),
        (dict(loss="kl_cov", kl_cov_coef=-1.0), "kl_cov_coef"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match) as e:
            PolicyLossSettings(**kw)
        assert "\n" not in str(e.value)
    PolicyLossSettings(loss="clip_cov", dual_clip=3.0)  # PPO's clip, so its dual clip too
    PolicyLossSettings(loss="cispo", ratio_level="sequence")  # GSPO's ratio as CISPO's IS weight
    hidden, weight, targets = _data(4, 8, 11)
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="loss must be one of"):
        linear_policy_loss(hidden, weight, targets, z, z, torch.ones(4), loss="dpo")


@pytest.mark.parametrize("loss, entropy_coef, ratio_level",
                         [(loss, e, "token") for loss in ("ppo", *LOSS_SETTINGS) for e in (0.0, 0.001)]
                         + [(loss, 0.001, "sequence") for loss in ("ppo", "cispo")])  # GSPO's ratio: these two
def test_elementwise_blocks_change_nothing(monkeypatch, loss, entropy_coef, ratio_level):
    """The chunked path's elementwise stages over blocks of rows (kernels.chunked.
    ELEMENTWISE_BLOCK_BYTES, here 1 and 3 rows of a 701-token vocabulary) give the loss, the
    log-probs, the entropies and both gradients of the stages over whole chunks, whatever the
    loss, with and without the entropy term, in one pass and in two (GSPO's sequence ratio)."""
    from fastpo.kernels import chunked, cpu_rows

    # the eager stages are what this checks (the compiled CPU ones have tests of their own); the
    # module patched is the one the library runs (a top-level `import kernels.chunked` from the
    # repository root is another copy: patching it once left this test unable to fail)
    monkeypatch.setattr(cpu_rows, "usable", lambda z, t: False)
    hidden, weight, targets, old, adv, mask, isw, sid = _case(230, torch.float32, seed=13)
    settings = PolicyLossSettings(entropy_coef=entropy_coef, temperature=0.7, loss=loss, ratio_level=ratio_level,
                                  **LOSS_SETTINGS.get(loss, {}))

    def run():
        hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = linear_policy_loss(hh, ww, targets, old, adv, mask, seq_ids=sid, is_weights=isw, settings=settings,
                                 impl="chunked", chunk_size=64)
        out.loss.backward()
        return out.loss, out.logprob, out.entropy, hh.grad, ww.grad

    whole = run()
    assert chunked._block_rows(torch.empty(64, 701)) >= 64  # the default: one block per chunk at this size
    for rows in (1, 3):
        monkeypatch.setattr(chunked, "ELEMENTWISE_BLOCK_BYTES", rows * 701 * 4)
        assert chunked._block_rows(torch.empty(64, 701)) == rows
        for a, b in zip(run(), whole):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)  # fp32 sums over 701 in another order
