"""The compiled CPU row routines (fastpo/kernels/cpu_rows.py, fastpo/kernels/_cpu_rows.c) against the eager
PyTorch stages they replace, and their fallbacks."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastpo.kernels import chunked, cpu_rows, linear_logprob_entropy, linear_policy_loss, reference_logprob_entropy

HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None or shutil.which("gcc") is not None


def _eager(z, t, g_lp, g_ent, inv_t):
    z = z.clone()
    logp, p, s, lse, ent, lp = chunked._softmax_stats(z, t, torch.empty_like(z))
    dz = chunked._dz_(p, logp, t, ent, g_lp, g_ent, inv_t, s)
    return lse, ent, lp, dz


def _exact(z, t, g_lp, g_ent, inv_t):
    """The same quantities in fp64 from torch's log_softmax."""
    zd = z.double()
    logp = zd.log_softmax(-1)
    p = logp.exp()
    lse = torch.logsumexp(zd, -1)
    ent = -(p * logp).sum(-1)
    lp = logp.gather(1, t[:, None]).squeeze(1)
    dz = -p * (g_lp.double()[:, None] + g_ent.double()[:, None] * (logp + ent[:, None]))
    dz[torch.arange(len(t)), t] += g_lp.double()
    return lse, ent, lp, dz * inv_t


def _compiled(z, t, g_lp, g_ent, inv_t, store_exp=True):
    z = z.clone()
    assert cpu_rows.usable(z, t)
    stats = cpu_rows.row_stats(z, t, store_exp=store_exp)
    lse, ent, lp = stats
    return lse, ent, lp, cpu_rows.row_dz_(z, t, stats, ent, g_lp, g_ent, inv_t)


def test_built_where_a_compiler_exists():
    assert (cpu_rows.status() == "ok") == HAS_CC, cpu_rows.status()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: the fallback is tested below")
@pytest.mark.parametrize("rows,vocab", [(1, 5), (7, 1003), (33, 4099), (3, 49152)])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("store_exp", [False, True])
def test_rows_match_the_eager_stages(rows, vocab, entropy, store_exp):
    g = torch.Generator().manual_seed(rows * vocab)
    z = torch.randn(rows, vocab, generator=g) * 6
    z[0, : min(3, vocab)] += 40.0  # a peaked row
    t = torch.randint(0, vocab, (rows,), generator=g)
    g_lp = torch.randn(rows, generator=g)
    g_ent = torch.randn(rows, generator=g) * 0.1 if entropy else torch.zeros(rows)
    exact = _exact(z, t, g_lp, g_ent, 1 / 0.7)
    got = _compiled(z, t, g_lp, g_ent, 1 / 0.7, store_exp)
    eager = _eager(z, t, g_lp, g_ent, 1 / 0.7)
    for name, a, b, e in zip(("lse", "entropy", "logprob", "dz"), got, exact, eager):
        # within fp32 rounding of the exact values (libmvec's expf: <= 4 ulp); the eager ops'
        # entropy, one long fp32 dot per row, is the less exact of the two at V = 49152
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=3e-6, msg=name)
        torch.testing.assert_close(e.double(), b, rtol=1e-4, atol=3e-6, msg=name)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_strided_rows_and_thread_count_do_not_change_the_bits():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(9, 700, generator=g) * 4
    z = big[:, :611]  # row stride 700, unit column stride
    t = torch.randint(0, 611, (9,), generator=g)
    g_lp, g_ent = torch.randn(9, generator=g), torch.randn(9, generator=g) * 0.1
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            zz = big.clone()[:, :611]
            lse, ent, lp = cpu_rows.row_stats(zz, t)  # the backward's form: log p from the lse
            outs.append((lse, ent, lp, cpu_rows.row_dz_(zz, t, lse, ent, g_lp, g_ent, 1.0).clone()))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    for a, b in zip(outs[0], _exact(z, t, g_lp, g_ent, 1.0)):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-6)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_a_non_finite_row_stays_in_its_row():
    z = torch.randn(3, 257)
    z[1, 5] = float("nan")
    t = torch.tensor([0, 1, 256])
    lse, ent, lp, dz = _compiled(z, t, torch.ones(3), torch.zeros(3), 1.0)
    assert torch.isnan(lse[1]) and torch.isfinite(lse[[0, 2]]).all() and torch.isfinite(dz[[0, 2]]).all()


def test_chunked_path_against_the_reference_fp32_and_bf16():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        h = (torch.randn(70, 32, generator=g) * 0.5).to(dtype)
        w = (torch.randn(1001, 32, generator=g) * 0.5).to(dtype)
        t = torch.randint(0, 1001, (70,), generator=g)
        lp, ent = linear_logprob_entropy(h, w, t, 0.8, impl="chunked", chunk_size=16)
        lp_r, ent_r = reference_logprob_entropy(h, w, t, 0.8)
        torch.testing.assert_close(lp, lp_r.to(lp.dtype), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ent, ent_r.to(ent.dtype), rtol=1e-4, atol=1e-4)


def test_out_of_range_target_still_raises():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    z = torch.randn(4, 10)
    assert not cpu_rows.usable(z, torch.tensor([0, 1, 10, 2])) and not cpu_rows.usable(z, torch.tensor([0, -1, 1, 2]))
    with pytest.raises((IndexError, RuntimeError)):  # the chunked path's own (eager) gather
        chunked.chunked_stats(h, w, torch.tensor([0, 1, 10, 2]))
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        linear_logprob_entropy(h, w, torch.tensor([0, 1, 10, 2]), impl="chunked")


@pytest.mark.parametrize("env", [{"FASTPO_CPU_ROWS": "0"}, {"FASTPO_CPU_ROWS": "off"},
                                 {"CC": "/nonexistent/cc", "PATH": "/nonexistent"}])
def test_without_the_routines_the_eager_ops_give_the_same_loss(env, tmp_path):
    """Turned off, or no compiler (a fresh cache): one warning at most, the same numbers."""
    code = """
import warnings, torch
warnings.simplefilter("always")
from fastpo.kernels import cpu_rows, linear_policy_loss
g = torch.Generator().manual_seed(0)
h = torch.randn(40, 16, generator=g, requires_grad=True); w = torch.randn(300, 16, generator=g)
t = torch.randint(0, 300, (40,), generator=g)
with warnings.catch_warnings(record=True) as caught:
    out = linear_policy_loss(h, w, t, torch.zeros(40), torch.randn(40, generator=g), torch.ones(40),
                             entropy_coef=0.01, impl="chunked", chunk_size=16)
    out.loss.backward()
    linear_policy_loss(h, w, t, torch.zeros(40), torch.ones(40), torch.ones(40), impl="chunked")
print(cpu_rows.status())
print(sum("CPU row kernels" in str(c.message) for c in caught))
print(repr(out.loss.item()), repr(h.grad.abs().sum().item()))
"""
    run_env = {**os.environ, "FASTPO_CACHE": str(tmp_path), **env}
    if "PATH" in env:  # keep python reachable by its full path
        run_env["PATH"] = env["PATH"]
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=300)
    assert got.returncode == 0, got.stderr
    status, warned, numbers = got.stdout.strip().splitlines()
    assert status.startswith("off (")
    assert warned == ("0" if "FASTPO_CPU_ROWS" in env else "1")
    if HAS_CC:  # the same loss with the routines, to fp32 rounding
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        h = torch.randn(40, 16, generator=g, requires_grad=True)
        w = torch.randn(300, 16, generator=g)
        t = torch.randint(0, 300, (40,), generator=g)
        out = linear_policy_loss(h, w, t, torch.zeros(40), torch.randn(40, generator=g), torch.ones(40),
                                 entropy_coef=0.01, impl="chunked", chunk_size=16)
        out.loss.backward()
        loss, grad = (float(x) for x in numbers.split())
        assert out.loss.item() == pytest.approx(loss, rel=1e-5)
        assert h.grad.abs().sum().item() == pytest.approx(grad, rel=1e-5)


def test_loading_the_routines_keeps_subnormal_numbers():
    """Linked with -ffast-math, a shared library turns on flush-to-zero for the whole process
    when it loads (crtfastmath.o); it must not."""
    code = """
import torch
from fastpo.kernels import cpu_rows, linear_logprob_entropy
linear_logprob_entropy(torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,)), impl="chunked")
print(cpu_rows.status(), 1e-300 * 1e-10 > 0, bool(torch.tensor([1e-40]) > 0))
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [("ok" if HAS_CC else got.stdout.split()[0]), "True", "True"]


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_mis_shaped_rows_are_refused_not_read_past():
    z = torch.randn(6, 50)
    t = torch.randint(0, 50, (6,))
    assert not cpu_rows.usable(z, t[:5]) and not cpu_rows.usable(z, t.to(torch.uint8))
    with pytest.raises(ValueError, match="cannot take"):
        cpu_rows.row_stats(z, t[:5])
    stats = cpu_rows.row_stats(z, t, store_exp=True)
    with pytest.raises(ValueError, match="g_lp must hold one value per row"):
        cpu_rows.row_dz_(z, t, stats, stats[1], torch.ones(5), torch.zeros(6), 1.0)
    with pytest.raises(ValueError, match="lse must hold one value per row"):
        cpu_rows.row_dz_(z, t, stats[0][:3], stats[1], torch.ones(6), torch.zeros(6), 1.0)
    h, w = torch.randn(64, 16), torch.randn(1000, 16)
    with pytest.raises((ValueError, RuntimeError, IndexError)):  # short targets: the eager ops' shape error
        chunked.chunked_fused(h, w, torch.randint(0, 1000, (59,)), 1.0,
                              lambda s, lp, e: (torch.ones_like(lp), torch.zeros_like(e)))


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_a_nan_row_stays_nan_with_an_entropy_term():
    z = torch.randn(2, 40)
    z[1, 3] = float("nan")
    t = torch.tensor([0, 1])
    *_, dz = _compiled(z, t, torch.ones(2), torch.full((2,), 0.5), 1.0)
    assert torch.isfinite(dz[0]).all() and torch.isnan(dz[1]).any()


def test_a_compiler_that_writes_nothing_does_not_poison_the_cache(tmp_path):
    """`true` as the compiler exits 0 and writes no library: a warning, the eager ops, and no
    empty file left in the cache for the next process."""
    code = """
import warnings, torch
warnings.simplefilter("always")
from fastpo.kernels import cpu_rows
print(cpu_rows.status())
"""
    env = {**os.environ, "FASTPO_CACHE": str(tmp_path), "CC": "true"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("off (") and "CPU row kernels could not be built" in got.stderr
    assert list(tmp_path.iterdir()) == []
