"""The compiled decode attention over a paged KV cache (fastpo/kernels/cpu_attention.py,
fastpo/kernels/_cpu_attention.c) against its PyTorch reference and plain attention."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastpo.kernels import cpu_attention
from fastpo.kernels.cpu_attention import BLOCK

HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None or shutil.which("gcc") is not None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the fallback is tested below")


def _paged(lengths, Hkv, D, spare_blocks=3, seed=0):
    """Random keys/values of rows `lengths` in shuffled blocks of a pool; every slot no row
    holds is NaN, so that a read of one shows. Returns (kpool, vpool, table, lens, dense K, V)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [(n + BLOCK - 1) // BLOCK for n in lengths]
    NB = sum(nbs) + spare_blocks
    order = torch.randperm(NB, generator=g)
    kp = torch.full((NB, Hkv, D, BLOCK), float("nan"))
    vp = torch.full((NB, Hkv, BLOCK, D), float("nan"))
    table = torch.zeros(len(lengths), max(nbs) + 1, dtype=torch.int32)
    dense_k, dense_v = [], []
    used = 0
    for r, (n, nb) in enumerate(zip(lengths, nbs)):
        blocks = order[used:used + nb]
        used += nb
        table[r, :nb] = blocks.int()
        k = torch.randn(Hkv, n, D, generator=g)
        v = torch.randn(Hkv, n, D, generator=g)
        for i in range(n):
            kp[blocks[i // BLOCK], :, :, i % BLOCK] = k[:, i]
            vp[blocks[i // BLOCK], :, i % BLOCK, :] = v[:, i]
        dense_k.append(k)
        dense_v.append(v)
    return kp, vp, table, torch.tensor(lengths), dense_k, dense_v


def _plain(q, dense_k, dense_v, scale):
    """Attention of each row's query [Hq, D] over its own K, V [Hkv, n, D], in fp64."""
    out = []
    for r in range(q.shape[0]):
        k, v = dense_k[r].double(), dense_v[r].double()
        g = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        p = torch.softmax(scale * torch.einsum("hd,hnd->hn", q[r].double(), k), -1)
        out.append(torch.einsum("hn,hnd->hd", p, v))
    return torch.stack(out)


@needs_cc
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (14, 2, 64), (4, 4, 128), (4, 2, 16), (8, 1, 32)])
def test_decode_matches_plain_attention_and_the_reference(Hq, Hkv, D):
    lengths = [1, 15, 16, 17, 33, 200, 5]  # one token, block edges, several blocks
    kp, vp, table, lens, dk, dv = _paged(lengths, Hkv, D)
    q = torch.randn(len(lengths), Hq, D, generator=torch.Generator().manual_seed(1))
    scale = D ** -0.5
    assert cpu_attention.usable(q, kp, vp)
    got = cpu_attention.paged_decode(q, kp, vp, table, lens, scale)
    assert torch.isfinite(got).all()  # the NaN in the unused slots was never read
    exact = _plain(q, dk, dv, scale)
    torch.testing.assert_close(got.double(), exact, atol=2e-6, rtol=1e-5)
    ref = cpu_attention.paged_decode_reference(q, kp, vp, table, lens, scale)  # the NaN never reaches it either
    torch.testing.assert_close(ref.double(), exact, atol=2e-6, rtol=1e-5)


@needs_cc
def test_decode_does_not_depend_on_the_thread_count():
    kp, vp, table, lens, *_ = _paged([40, 3, 90, 17], 2, 64)
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_decode(q, kp, vp, table, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_attention.paged_decode(q, kp, vp, table, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_cc
def test_bad_tables_lengths_and_shapes_are_refused_not_read_past():
    kp, vp, table, lens, *_ = _paged([20, 7], 2, 16)
    q = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, "):
        cpu_attention.paged_decode(q, kp, vp, table + kp.shape[0], lens, 0.25)
    with pytest.raises(ValueError, match="row lengths must be in"):
        cpu_attention.paged_decode(q, kp, vp, table, torch.tensor([20, 0]), 0.25)
    with pytest.raises(ValueError, match="row lengths must be in"):
        cpu_attention.paged_decode(q, kp, vp, table[:, :1], lens, 0.25)
    with pytest.raises(ValueError, match="query heads"):
        cpu_attention.paged_decode(torch.randn(2, 3, 16), kp, vp, table, lens, 0.25)
    with pytest.raises(ValueError, match="pools of shapes"):
        cpu_attention.paged_decode(q, kp[:, :, :8].contiguous(), vp, table, lens, 0.25)
    assert not cpu_attention.usable(q.double(), kp.double(), vp.double())  # fp32 only: the reference takes it
    out = cpu_attention.paged_decode_reference(q.double(), kp.double(), vp.double(), table, lens, 0.25)
    assert out.dtype == torch.float64 and out.shape == (2, 4, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("env", [{"FASTPO_CPU_ATTENTION": "0"}, {"CC": "/nonexistent/cc", "PATH": "/nonexistent"}])
def test_without_the_routine_it_is_not_usable(env, tmp_path):
    """Turned off, or no compiler (a fresh cache): `usable` is False (one warning without a
    compiler, none when turned off), and the reference still computes."""
    code = """
import warnings, torch
warnings.simplefilter("always")
from fastpo.kernels import cpu_attention
q, kp, vp = torch.randn(1, 2, 16), torch.randn(3, 1, 16, 16), torch.randn(3, 1, 16, 16)
with warnings.catch_warnings(record=True) as caught:
    ok = cpu_attention.usable(q, kp, vp)
    out = cpu_attention.paged_decode_reference(q, kp, vp, torch.tensor([[2]]), torch.tensor([5]), 0.25)
print(cpu_attention.status())
print(ok, sum("decode attention" in str(c.message) for c in caught), bool(torch.isfinite(out).all()))
"""
    run_env = {**os.environ, "FASTPO_CACHE": str(tmp_path), **env}
    if "PATH" in env:
        run_env["PATH"] = env["PATH"]
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=300)
    assert got.returncode == 0, got.stderr
    status, rest = got.stdout.strip().splitlines()
    assert status.startswith("off (")
    assert rest.split() == ["False", "0" if "FASTPO_CPU_ATTENTION" in env else "1", "True"]
