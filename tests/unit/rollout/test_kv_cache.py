"""The paged KV cache (fastpo/rollout/kv_cache.py) against a dense copy of every sequence:
sharing, copy on write, freeing and reuse, removal, truncation, attention and its accounting."""
import pytest
import torch

from fastpo.kernels.cpu_attention import BLOCK, gather_rows
from fastpo.rollout.kv_cache import PagedKVCache

LAYERS, H, HQ, D = 2, 2, 4, 16


class Dense:
    """What each sequence should hold: per layer, K and V [H, n, D]."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, seq, layer, k, v):
        kk = self.k.setdefault((seq, layer), torch.zeros(H, 0, D))
        vv = self.v.setdefault((seq, layer), torch.zeros(H, 0, D))
        self.k[seq, layer], self.v[seq, layer] = torch.cat([kk, k], 1), torch.cat([vv, v], 1)

    def copy(self, src, dst):
        for layer in range(LAYERS):
            self.k[dst, layer], self.v[dst, layer] = self.k[src, layer].clone(), self.v[src, layer].clone()


def _write(cache, dense, seqs, counts, gen, spare=0):
    """One forward of counts[i] new tokens on each of seqs: random q, k, v per layer; checks
    each sequence's queries attend to its tokens as plain causal attention would."""
    step = cache.plan(seqs, counts, spare)
    N = sum(counts)
    for layer in range(LAYERS):
        q, k, v = (torch.randn(1, n, N, D, generator=gen) for n in (HQ, H, H))
        out = cache.attend(layer, q, k, v, step, D ** -0.5)
        assert out.shape == (1, N, HQ, D)
        for i, s in enumerate(seqs):
            a, b = step.offsets[i], step.offsets[i + 1]
            dense.add(s, layer, k[0, :, a:b], v[0, :, a:b])
            K, V = dense.k[s, layer].double(), dense.v[s, layer].double()
            L = K.shape[1]
            assert L == cache.length(s) == step.lengths[i]
            K, V = K.repeat_interleave(HQ // H, 0), V.repeat_interleave(HQ // H, 0)
            scores = torch.einsum("hnd,hld->hnl", q[0, :, a:b].double(), K) * D ** -0.5
            seen = torch.arange(L)[None, :] <= torch.arange(L - (b - a), L)[:, None]
            want = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ V  # [HQ, n, D]
            torch.testing.assert_close(out[0, a:b].transpose(0, 1).double(), want, atol=1e-5, rtol=1e-5)
    return step


def _check_held(cache, dense):
    """Every sequence's blocks hold exactly its dense copy."""
    for s in cache.sequences():
        n = cache.length(s)
        table = torch.tensor([cache._tables[s] or [0]], dtype=torch.int32)
        for layer in range(LAYERS):
            k, v = gather_rows(cache.k_pools[layer], cache.v_pools[layer], table, n)
            assert torch.equal(k[0], dense.k[s, layer]) and torch.equal(v[0], dense.v[s, layer]), (s, layer)


def test_shared_blocks_copy_on_write_removal_and_reuse():
    gen = torch.Generator().manual_seed(0)
    cache, dense = PagedKVCache(LAYERS, H, D), Dense()
    root = cache.new()
    _write(cache, dense, [root], [40], gen)  # a prompt prefix: 2 full blocks and 8 tokens
    forks = [cache.fork(root) for _ in range(3)]
    for f in forks:
        dense.copy(root, f)
    cache.free(root)
    assert cache.held_tokens == 40  # one copy for the three
    # each fork writes into the shared, partly filled third block: copied first, the others intact
    _write(cache, dense, forks, [5, 1, 17], gen)
    _check_held(cache, dense)
    assert cache.held_tokens == 32 + 3 * 8 + 5 + 1 + 17
    for _ in range(20):  # decoding across block edges
        _write(cache, dense, forks, [1, 1, 1], gen)
    _check_held(cache, dense)
    # drop tokens [10, 30) of fork 0 (a context window's eviction): the rest moves down
    cache.remove(forks[0], 10, 30)
    for layer in range(LAYERS):
        for t in (dense.k, dense.v):
            x = t[forks[0], layer]
            t[forks[0], layer] = torch.cat([x[:, :10], x[:, 30:]], 1)
    _write(cache, dense, forks, [3, 1, 1], gen)
    _check_held(cache, dense)
    cache.truncate(forks[1], 35)  # rewind
    for layer in range(LAYERS):
        dense.k[forks[1], layer], dense.v[forks[1], layer] = (dense.k[forks[1], layer][:, :35],
                                                              dense.v[forks[1], layer][:, :35])
    _write(cache, dense, forks, [1, 6, 1], gen)
    _check_held(cache, dense)
    # forks 1 and 2 still share the two full blocks of the prefix; fork 0's removal inside them
    # gave it blocks of its own
    assert cache.held_tokens == sum(cache.length(s) for s in forks) - 32
    # a freed sequence's blocks serve the next writes: the pools do not grow
    cap = cache.capacity
    freed = -(-cache.length(forks[2]) // BLOCK) - 2
    cache.free(forks[2])
    _write(cache, dense, forks[:2], [freed * BLOCK // 2 - 4, freed * BLOCK // 2 - 4], gen)
    _check_held(cache, dense)
    assert cache.capacity == cap
    # the accounting: bytes held vs bytes of tokens held, both peaks
    per_token = 2 * LAYERS * H * D * 4
    assert cache.bytes_per_token() == per_token
    assert cache.stats["peak_kv_bytes"] == cache.capacity * BLOCK * per_token
    assert cache.stats["peak_kv_token_bytes"] >= cache.token_bytes() == cache.held_tokens * per_token


def test_pools_grow_by_an_eighth_at_least_and_keep_their_contents():
    gen = torch.Generator().manual_seed(1)
    cache, dense = PagedKVCache(LAYERS, H, D), Dense()
    seqs = [cache.new() for _ in range(4)]
    _write(cache, dense, seqs, [30, 17, 1, 64], gen)
    growths = cache.stats["pool_growths"]
    for _ in range(100):
        _write(cache, dense, seqs, [1] * 4, gen)
    _check_held(cache, dense)
    # 100 steps of 4 rows take 25 blocks: two growths of 16 blocks (MIN_GROWTH), not one per block
    assert cache.stats["pool_growths"] - growths == 2
    used = sum(-(-cache.length(s) // BLOCK) for s in seqs)
    assert used <= cache.capacity < used + 16


def test_spare_blocks_and_errors():
    gen = torch.Generator().manual_seed(2)
    cache, dense = PagedKVCache(LAYERS, H, D), Dense()
    s = cache.new()
    _write(cache, dense, [s], [20], gen, spare=10)
    assert len(cache._free) >= 10
    with pytest.raises(ValueError, match="distinct sequences and counts >= 1"):
        cache.plan([s, s], [1, 1])
    with pytest.raises(ValueError, match="distinct sequences and counts >= 1"):
        cache.plan([s], [0])
    with pytest.raises(ValueError, match=r"remove tokens \[5, 30\)"):
        cache.remove(s, 5, 30)
    with pytest.raises(ValueError, match="truncate to 21 tokens"):
        cache.truncate(s, 21)
    with pytest.raises(KeyError):
        cache.fork(99)
    cache.reset()
    assert cache.pool_bytes() == 0 and cache.sequences() == [] and cache.held_tokens == 0
    assert cache.stats["peak_kv_bytes"] > 0  # the peak stays until reset_stats
    cache.reset_stats()
    assert cache.stats["peak_kv_bytes"] == 0
