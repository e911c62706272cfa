"""fastpo.kernels' transformers adapter and dispatcher (impl="auto") on tiny randomly
initialised causal LMs, padded and packed rows.

The fused loss and its gradients (every parameter, tied LM head included) must equal the
obvious computation on `model(...).logits`.
"""
import pytest
import torch
import transformers

from fastpo.kernels import (aggregation_weights, causal_lm_hidden_states, causal_lm_logprob_entropy,
                            causal_lm_policy_loss, policy_loss_terms)

VOCAB = 257
CUDA = torch.cuda.is_available()


def _model(tied: bool, arch: str = "qwen2"):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64)
    cfg = transformers.Qwen2Config(**common) if arch == "qwen2" else transformers.LlamaConfig(**common)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model


def _batch(b=3, t=14, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    attn = torch.ones(b, t, dtype=torch.long)
    attn[1, 10:] = 0  # right padding
    mask = attn.clone().float()
    mask[:, :5] = 0  # prompt tokens
    mask[2, 8] = 0
    return ids, attn, mask, g


def _obvious_loss(model, ids, attn, old, adv, mask, temperature, **kw):
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], -1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    m = mask[:, 1:] > 0
    terms = policy_loss_terms(lp[m], ent[m], old[:, 1:][m], adv[:, 1:][m], **kw)
    return terms["loss"].sum() / m.sum(), lp, ent


# impl="auto" resolves to chunked on the CPU and to the compiled Triton kernels on CUDA (the
# `-m gpu` run of bench/gpu_check.sh)
@pytest.mark.parametrize("device,impl", [("cpu", "chunked"), ("cpu", "auto"), pytest.param(
    "cuda", "auto", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])])
@pytest.mark.parametrize("tied,arch", [(True, "qwen2"), (False, "llama")])
def test_adapter_loss_and_grads_equal_logits_computation(tied, arch, device, impl):
    model = _model(tied, arch).to(device)
    ids, attn, mask, g = _batch()
    with torch.no_grad():
        old, _ = causal_lm_logprob_entropy(model, ids.to(device), attention_mask=attn.to(device), temperature=0.5,
                                           mask=mask.to(device), impl=impl)
    old = old.cpu() + 0.2 * torch.randn(old.shape, generator=g)
    adv = torch.randn(old.shape, generator=g)
    ids, attn, mask, old, adv = (x.to(device) for x in (ids, attn, mask, old, adv))
    kw = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
    out = causal_lm_policy_loss(model, ids, old, adv, mask, attention_mask=attn, temperature=0.5, impl=impl,
                                **kw)
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss, lp, ent = _obvious_loss(model, ids, attn, old, adv, mask, 0.5, **kw)
    loss.backward()
    # on CUDA the two sides reduce in other orders (Triton tiles, cuBLAS, SDPA kernels)
    atol = 1e-6 if device == "cpu" else 1e-5
    torch.testing.assert_close(out.loss, loss, atol=atol, rtol=1e-5)
    m = mask > 0
    torch.testing.assert_close(out.logprob[:, 1:][m[:, 1:]], lp.detach()[m[:, 1:]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy[:, 1:][m[:, 1:]], ent.detach()[m[:, 1:]], atol=1e-5, rtol=1e-5)
    assert bool((out.logprob[~m] == 0).all()) and bool((out.entropy[~m] == 0).all())
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, atol=atol, rtol=1e-4 if device == "cpu" else 1e-3, msg=n)
    assert out.metrics["clipfrac"] > 0


def test_logprob_entropy_defaults_to_attention_mask():
    model = _model(True)
    ids, attn, _, _ = _batch()
    lp, ent = causal_lm_logprob_entropy(model, ids, attention_mask=attn)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float()[:, :-1], -1)
    ref = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = attn[:, 1:] > 0
    torch.testing.assert_close(lp[:, 1:][keep], ref[keep], atol=1e-5, rtol=1e-5)
    assert bool((lp[:, 0] == 0).all()) and bool((lp[:, 1:][~keep] == 0).all())
    assert lp.dtype == ent.dtype == torch.float32 and bool((ent[:, 1:][keep] > 0).all())


def test_packed_row_with_block_diagonal_mask_matches_separate_sequences():
    model = _model(True)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, VOCAB, (1, 7), generator=g), torch.randint(0, VOCAB, (1, 9), generator=g)
    ids = torch.cat([a, b], 1)
    t = ids.shape[1]
    seg = torch.tensor([0] * 7 + [1] * 9)
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    mask4d = (causal & (seg[:, None] == seg[None, :]))[None, None]
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    loss_mask = torch.ones(1, t)
    loss_mask[0, 0] = 0
    loss_mask[0, 7] = 0  # start of the second sequence
    lp, ent = causal_lm_logprob_entropy(model, ids, attention_mask=mask4d, position_ids=pos, mask=loss_mask)
    lp_a, _ = causal_lm_logprob_entropy(model, a)
    lp_b, _ = causal_lm_logprob_entropy(model, b)
    torch.testing.assert_close(lp[0, 1:7], lp_a[0, 1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp[0, 8:], lp_b[0, 1:], atol=1e-5, rtol=1e-5)
    assert lp[0, 7] == 0
    # seq-mean-token-mean over the two packed sequences == mean of the two per-sequence means
    old, adv = lp.detach(), torch.cat([torch.full((7,), 1.0), torch.full((9,), -2.0)])[None]
    out = causal_lm_policy_loss(model, ids, old, adv, loss_mask, attention_mask=mask4d, position_ids=pos,
                                seq_ids=seg[None], loss_agg="seq-mean-token-mean", entropy_coef=0.1)
    ea = ent[0, 1:7].mean()
    eb = ent[0, 8:].mean()
    expected = 0.5 * ((-1.0 - 0.1 * ea) + (2.0 - 0.1 * eb))  # on-policy: ratio 1, pg = -A
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)
    assert out.metrics["ratio_max"] == 1.0 and out.metrics["ratio_min"] == 1.0


def _packed_pair(seed=5):
    """One row packing two sequences (7 and 9 tokens) with a block-diagonal 4D mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, 16), generator=g)
    seg = torch.tensor([0] * 7 + [1] * 9)
    causal = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    mask4d = (causal & (seg[:, None] == seg[None, :]))[None, None]
    pos = torch.cat([torch.arange(7), torch.arange(9)])[None]
    loss_mask = torch.ones(1, 16)
    loss_mask[0, [0, 1, 7, 8]] = 0  # sequence starts, and one prompt token each
    return ids, seg, mask4d, pos, loss_mask, g


def test_packed_row_gradients_equal_logits_computation():
    model = _model(True)
    ids, seg, mask4d, pos, loss_mask, g = _packed_pair()
    with torch.no_grad():
        lp0, _ = causal_lm_logprob_entropy(model, ids, attention_mask=mask4d, position_ids=pos, mask=loss_mask)
    old = lp0 + 0.3 * torch.randn(lp0.shape, generator=g)  # off-policy: some tokens clipped
    adv = torch.cat([torch.full((7,), 1.5), torch.full((9,), -0.7)])[None]
    kw = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.05)
    out = causal_lm_policy_loss(model, ids, old, adv, loss_mask, attention_mask=mask4d, position_ids=pos,
                                seq_ids=seg[None], loss_agg="seq-mean-token-mean", temperature=0.7, **kw)
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # the obvious computation: the model's logits on the packed row, shifted by one
    logits = model(input_ids=ids, attention_mask=mask4d, position_ids=pos).logits.float()[0, :-1] / 0.7
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    m = loss_mask[0, 1:] > 0
    terms = policy_loss_terms(lp[m], ent[m], old[0, 1:][m], adv[0, 1:][m], **kw)
    w = aggregation_weights(torch.ones(int(m.sum())), "seq-mean-token-mean", seg[1:][m])
    loss = (terms["loss"] * w).sum()
    loss.backward()
    torch.testing.assert_close(out.loss, loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.logprob[0, 1:][m], lp.detach()[m], atol=1e-5, rtol=1e-5)
    assert out.metrics["clipfrac"] > 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)


def test_packed_row_sequence_ratio_and_is_weights_equal_logits_computation():
    """GSPO's ratio over each packed sequence (seq_ids) and per-token IS weights [B, T] go
    through the adapter: same loss and gradients as the obvious computation."""
    from fastpo.kernels import sequence_log_ratio

    model = _model(True)
    ids, seg, mask4d, pos, loss_mask, g = _packed_pair()
    with torch.no_grad():
        lp0, _ = causal_lm_logprob_entropy(model, ids, attention_mask=mask4d, position_ids=pos, mask=loss_mask)
    shift = torch.where(seg == seg[0], 0.4, -0.3)[None]  # sequence 0 moved up, sequence 1 down
    old = lp0 - shift + 0.05 * torch.randn(lp0.shape, generator=g)
    adv = torch.cat([torch.full((7,), 1.5), torch.full((9,), -0.7)])[None]
    isw = torch.rand(ids.shape, generator=g) + 0.5
    kw = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.05)
    out = causal_lm_policy_loss(model, ids, old, adv, loss_mask, attention_mask=mask4d, position_ids=pos,
                                seq_ids=seg[None], is_weights=isw, ratio_level="sequence",
                                loss_agg="seq-mean-token-mean", temperature=0.7, **kw)
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask4d, position_ids=pos).logits.float()[0, :-1] / 0.7
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    m = loss_mask[0, 1:] > 0
    sid = seg[1:][m]
    slr = sequence_log_ratio(lp[m], old[0, 1:][m], torch.ones(int(m.sum())), sid)
    terms = policy_loss_terms(lp[m], ent[m], old[0, 1:][m], adv[0, 1:][m], seq_log_ratio=slr,
                              is_weights=isw[0, 1:][m], **kw)
    w = aggregation_weights(torch.ones(int(m.sum())), "seq-mean-token-mean", sid)
    loss = (terms["loss"] * w).sum()
    loss.backward()
    torch.testing.assert_close(out.loss, loss, atol=1e-6, rtol=1e-5)
    assert out.metrics["clipfrac"] > 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)
    with pytest.raises(ValueError, match="is_weights must be a tensor of shape"):
        causal_lm_policy_loss(model, ids, old, adv, loss_mask, is_weights=isw[:, 1:])


def test_negative_seq_ids_stay_apart_across_rows():
    model = _model(True)
    ids, attn, mask, g = _batch()
    attn[:] = 1
    old, adv = -5.0 + 0.1 * torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    kw = dict(loss_agg="seq-mean-token-sum", entropy_coef=0.01)
    by_row = causal_lm_policy_loss(model, ids, old, adv, mask, **kw)  # one sequence per row
    # ids -1 / 0 / -1: equal ids in rows 0 and 2 must still be two sequences (offsets
    # row * (max + 1) + id would give rows 1 and 2 the same id, 1)
    sid = torch.tensor([-1, 0, -1])[:, None].expand_as(ids)
    neg = causal_lm_policy_loss(model, ids, old, adv, mask, seq_ids=sid, **kw)
    torch.testing.assert_close(neg.loss, by_row.loss)
    with pytest.raises(TypeError, match="seq_ids must be an integer tensor"):
        causal_lm_policy_loss(model, ids, old, adv, mask, seq_ids=sid.float(), **kw)
    bad = mask.clone()
    bad[1, 6] = -1.0
    with pytest.raises(ValueError, match="loss_mask must be finite and >= 0, found -1.0"):
        causal_lm_policy_loss(model, ids, old, adv, bad, **kw)


def test_hidden_states_are_the_decoder_body_output():
    model = _model(False, "llama")
    ids, attn, _, _ = _batch()
    h = causal_lm_hidden_states(model, ids, attention_mask=attn)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(h @ model.lm_head.weight.T, logits, atol=1e-5, rtol=1e-5)


def test_adapter_errors():
    model = _model(True)
    ids, attn, mask, _ = _batch()
    bad = mask.clone()
    bad[0, 0] = 1
    z = torch.zeros_like(mask)
    with pytest.raises(ValueError, match=r"loss_mask\[:, 0\]"):
        causal_lm_policy_loss(model, ids, z, z, bad)
    with pytest.raises(ValueError, match="advantages"):
        causal_lm_policy_loss(model, ids, z, z[:, :-1], mask)
    with pytest.raises(ValueError, match="'fast'"):
        causal_lm_policy_loss(model, ids, z, z, mask, impl="fast")
    packed = torch.zeros_like(ids)
    packed[:, 9:] = 1  # a second sequence starts at column 9, where mask is 1
    with pytest.raises(ValueError, match="first token of every packed sequence"):
        causal_lm_policy_loss(model, ids, z, z, mask, seq_ids=packed)
