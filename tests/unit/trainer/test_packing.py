"""Packing: budgets respected, no padding, and packed log-probs equal one-trajectory-at-a-time log-probs."""
import pytest
import torch
import transformers

from fastpo.packing import (SEGMENT_ATTENTION, block_causal_mask, pack_micro_batch, packing_attention, pad_micro_batch,
                            plan_micro_batches, shared_prefixes, use_segment_attention)


def test_plan_respects_budget_and_covers_all():
    lengths = [5, 9, 3, 7, 2, 12, 4]
    plan = plan_micro_batches(lengths, 12)
    flat = sorted(i for mb in plan for i in mb)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= 12 for mb in plan)
    assert plan == [[0, 3], [1, 2], [4, 6], [5]]  # 42 tokens in 4 bins of 12: the minimum
    over = plan_micro_batches([30, 2], 10)
    assert [0] in over and [1] in over  # too-long trajectory alone
    with pytest.raises(ValueError):
        plan_micro_batches([1, 0], 10)
    with pytest.raises(ValueError):
        plan_micro_batches([1], 0)


def test_block_causal_mask_values():
    m = block_causal_mask([2, 3])[0, 0]
    allowed = (m == 0).int().tolist()
    assert block_causal_mask([2, 3], torch.bool)[0, 0].int().tolist() == allowed
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def _tiny(kind, attn):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = transformers.Qwen2ForCausalLM(cfg)
    if attn == "segments":
        model.config._attn_implementation = "sdpa"
        assert use_segment_attention(model)
        assert model.config._attn_implementation == SEGMENT_ATTENTION and packing_attention(model) == "segments"
    else:
        model.config._attn_implementation = attn
        assert packing_attention(model) == "mask"
    return model.eval()


def _token_logprobs(logits, ids):
    lp = torch.log_softmax(logits.float(), -1)[:, :-1]
    return torch.gather(lp, -1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", "segments"])
def test_packed_logprobs_equal_one_at_a_time(kind, attn):
    model = _tiny(kind, attn)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (7, 13, 4, 10)]
    plan = plan_micro_batches([len(s) for s in seqs], 24)
    assert len(plan) >= 2 and any(len(mb) > 1 for mb in plan)
    with torch.no_grad():
        alone = [_token_logprobs(model(s[None]).logits, s[None])[0] for s in seqs]
        seen = set()
        for mb in plan:
            pb = pack_micro_batch(seqs, mb, attention=packing_attention(model),
                                  mask_dtype=torch.bool if attn == "sdpa" else torch.float32)
            assert pb.num_tokens == sum(len(seqs[i]) for i in mb)  # no padding tokens
            assert (pb.attention_mask is None) == (attn == "segments")
            logits = model(**pb.model_inputs()).logits
            lp_all = torch.log_softmax(logits.float(), -1)[0]
            for j, (i, piece) in enumerate(zip(pb.indices, pb.split(lp_all))):
                ids = seqs[i]
                lp = torch.gather(piece[:-1], -1, ids[1:, None])[:, 0]
                torch.testing.assert_close(lp, alone[i], atol=1e-5, rtol=1e-5)
                seen.add(i)
        assert seen == set(range(len(seqs)))
        # Without the mask the packed row would attend across trajectories: the test can fail.
        pb = pack_micro_batch(seqs, [0, 1])
        bad = model(input_ids=pb.input_ids, position_ids=pb.position_ids).logits
        lp_bad = torch.log_softmax(bad.float(), -1)[0][len(seqs[0]):-1]
        lp_bad = torch.gather(lp_bad, -1, seqs[1][1:, None])[:, 0]
        if attn == "eager":  # transformers' packed-sequence detection is sdpa/flash only
            assert not torch.allclose(lp_bad, alone[1], atol=1e-4)


def test_gather_split_and_padding_baseline():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6])]
    pb = pack_micro_batch(seqs, [0, 2])
    assert pb.input_ids.tolist() == [[1, 2, 3, 6]] and pb.position_ids.tolist() == [[0, 1, 2, 0]]
    assert pb.seq_ids.tolist() == [0, 0, 0, 1] and pb.cu_seqlens.tolist() == [0, 3, 4]
    assert pb.gather([s * 10 for s in seqs]).tolist() == [[10, 20, 30, 60]]
    assert [t.tolist() for t in pb.split(pb.input_ids)] == [[1, 2, 3], [6]]
    ids, att = pad_micro_batch(seqs, [0, 1], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 5, 0]] and att.tolist() == [[1, 1, 1], [1, 1, 0]]


def test_segment_attention_gradients_and_unpacked_use():
    """Segment attention: packed gradients equal the sum of one-at-a-time gradients, and
    padded batched forwards (generation's case) are plain sdpa's."""
    seqs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5, 12)]
    ref = _tiny("qwen2", "sdpa")
    seg = _tiny("qwen2", "segments")
    seg.load_state_dict(ref.state_dict())

    def nll(model, **inputs):
        logits = model(**inputs).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits, inputs["input_ids"][0, 1:], reduction="sum")

    for s in seqs:
        nll(ref, input_ids=s[None]).backward()
    pb = pack_micro_batch(seqs, [0, 1, 2], attention="segments")
    logits = seg(**pb.model_inputs()).logits[0]
    loss = sum(torch.nn.functional.cross_entropy(piece[:-1], seqs[i][1:], reduction="sum")
               for i, piece in zip(pb.indices, pb.split(logits)))
    loss.backward()
    for (name, p), q in zip(ref.named_parameters(), seg.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    # right-padded batch with a 2D mask, as the rollout engine and the padded baseline use
    ids, att = pad_micro_batch(seqs, [0, 1, 2])
    with torch.no_grad():
        torch.testing.assert_close(seg(input_ids=ids, attention_mask=att).logits,
                                   ref(input_ids=ids, attention_mask=att).logits)
    with pytest.raises(ValueError, match="attention must be one of"):
        pack_micro_batch(seqs, [0], attention="dense")


def _grouped_batch():
    """Two env groups: members share a prompt (loss mask 0), then differ (loss mask 1 on parts)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in (11, 6)]
    seqs, masks = [], []
    for grp, tails in ((0, (5, 9, 3)), (1, (7, 4))):
        for n in tails:
            tail = torch.randint(0, 97, (n,), generator=g)
            seqs.append(torch.cat([prompts[grp], tail]))
            m = torch.zeros(len(seqs[-1]), dtype=torch.bool)
            m[len(prompts[grp]):] = True
            m[-1] = False  # a between-turn token the model did not generate
            masks.append(m)
    return seqs, masks, [len(p) for p in prompts]


def test_shared_prefixes_and_plan():
    seqs, masks, plen = _grouped_batch()
    lengths, groups = shared_prefixes(seqs, masks)
    assert lengths == [plen[0]] * 3 + [plen[1]] * 2
    assert groups[0] == groups[1] == groups[2] != groups[3] == groups[4]
    # no trained token: the prefix stops one token short of the end
    assert shared_prefixes([torch.tensor([1, 2, 3])], [torch.zeros(3, dtype=torch.bool)])[0] == [2]
    L = [len(s) for s in seqs]
    plan = plan_micro_batches(L, 40, lengths, groups)
    assert sorted(i for mb in plan for i in mb) == list(range(5))
    for mb in plan:  # each micro-batch's computed tokens (prefix once per group) fit the budget
        pb = pack_micro_batch(seqs, mb, attention="segments", prefix_lengths=lengths, prefix_groups=groups)
        assert pb.num_tokens <= 40 or len(mb) == 1
    pb = pack_micro_batch(seqs, [0, 1, 2], attention="segments", prefix_lengths=lengths, prefix_groups=groups)
    assert pb.num_tokens == plen[0] + 5 + 9 + 3 and pb.trajectory_tokens == sum(L[:3])
    assert pb.position_ids[0, plen[0]:plen[0] + 5].tolist() == list(range(plen[0], plen[0] + 5))
    with pytest.raises(ValueError, match="shared prefixes"):
        pb.split(pb.input_ids)
    with pytest.raises(ValueError, match="does not share"):
        bad = [seqs[0], torch.cat([seqs[1][:2] + 1, seqs[1][2:]])]
        pack_micro_batch(bad, [0, 1], attention="segments", prefix_lengths=[11, 11], prefix_groups=[0, 0])
    with pytest.raises(ValueError, match="both"):
        plan_micro_batches(L, 40, lengths, None)


def _common_head_batch():
    """Four trajectories opening with the same 6 tokens (a chat header and instructions), then
    each its own prompt (a level) and trained answer tokens; one whose prompt differs at once."""
    g = torch.Generator().manual_seed(5)
    head = torch.randint(0, 97, (6,), generator=g)
    seqs, masks = [], []
    for own, ans in ((3, 4), (5, 2), (2, 6), (4, 3)):
        s = torch.cat([head, torch.randint(0, 97, (own + ans,), generator=g)])
        m = torch.zeros(len(s), dtype=torch.bool)
        m[6 + own:] = True
        seqs.append(s)
        masks.append(m)
    s = torch.randint(0, 97, (9,), generator=g)
    s[0] = (head[0] + 1) % 97
    seqs.append(s)
    masks.append(torch.arange(9) >= 5)
    return seqs, masks


def test_common_prefixes_group_prompts_that_only_begin_alike():
    seqs, masks = _common_head_batch()
    assert shared_prefixes(seqs, masks)[1] == [0, 1, 2, 3, 4]  # no two prompts are identical
    lengths, groups = shared_prefixes(seqs, masks, min_common=3)
    assert lengths[:4] == [6, 6, 6, 6] and lengths[4] == 5
    assert len(set(groups[:4])) == 1 and groups[4] != groups[0]
    loose = shared_prefixes(seqs, masks, min_common=7)
    assert len(set(loose[1])) == 5 and loose[0] == shared_prefixes(seqs, masks)[0]  # 6 < 7: nothing shared
    # identical prompts (env groups) that differ from their first token stay as they were
    seqs2, masks2, _ = _grouped_batch()
    assert seqs2[0][0] != seqs2[3][0]
    l2, g2 = shared_prefixes(seqs2, masks2, min_common=1)
    assert l2 == shared_prefixes(seqs2, masks2)[0] and g2[0] == g2[1] == g2[2] != g2[3] == g2[4]


CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("kind,device,common", [
    ("llama", "cpu", 0), ("qwen2", "cpu", 0), ("llama", "cpu", 3),
    pytest.param("qwen2", "cuda", 0, marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])])
def test_shared_prefix_logprobs_and_gradients_equal_one_at_a_time(kind, device, common):
    """A row holding a group's prompt once gives every member the log-probs and the summed
    gradients of computing each trajectory on its own; also when the group shares only the
    prompts' first tokens (`min_common`, as SFT packs)."""
    seqs, masks = _common_head_batch() if common else _grouped_batch()[:2]
    ref = _tiny(kind, "sdpa").to(device)
    seg = _tiny(kind, "segments").to(device)
    seg.load_state_dict(ref.state_dict())
    seqs = [s.to(device) for s in seqs]
    tol = 1e-5 if device == "cpu" else 1e-4  # CUDA's fused attention kernels round differently
    lengths, groups = shared_prefixes(seqs, masks, min_common=common)
    assert not common or len(set(groups)) == 2

    alone = []
    for s, m in zip(seqs, masks):
        lp = _token_logprobs(ref(s[None]).logits, s[None])[0]  # lp[t-1] is token t's
        alone.append(lp)
        (-(lp * m[1:].to(device)).sum()).backward()
    total = 0.0
    for mb in plan_micro_batches([len(s) for s in seqs], 30, lengths, groups):
        pb = pack_micro_batch(seqs, mb, attention="segments", prefix_lengths=lengths, prefix_groups=groups,
                              device=device)
        sc = pb.scored(masks)
        logits = seg(**pb.model_inputs()).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[sc.rows].gather(1, sc.targets[:, None])[:, 0]
        out = [torch.zeros(len(s)) for s in seqs]
        sc.scatter(lp, out)
        for i, pos in zip(sc.indices, sc.positions):
            torch.testing.assert_close(out[i][pos], alone[i][pos - 1].detach().cpu(), atol=tol, rtol=tol)
            total += pos.numel()
        (-lp.sum()).backward()
    assert total == sum(int(m[1:].sum()) for m in masks)
    for (name, p), q in zip(ref.named_parameters(), seg.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=tol, rtol=10 * tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["eager", "sdpa", "segments"])
def test_trainer_micro_batches_carry_the_mask_the_attention_takes(attn, dtype):
    """The trainer's packed micro-batches (`LogProbComputer.micro_batches`, which the old log-probs and
    the update read) give each attention the mask it takes: eager adds an additive mask to its
    scores, built as transformers builds its own eager masks (0 / finfo.min in the dtype of the
    model's hidden states: a float32 mask would turn a bf16 model's [N, N] scores into float32);
    sdpa takes a boolean one; segment attention none. The packed log-probs equal the
    one-trajectory-at-a-time ones."""
    from fastpo.config import load_config
    from fastpo.trainer.batch import TrainBatch
    from fastpo.trainer.models import Models
    from fastpo.trainer.plan import SUPERVISED
    from fastpo.trainer.logprobs import LogProbComputer

    model = _tiny("llama", attn).to(dtype)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (7, 13, 4, 10)]
    masks = [torch.arange(len(s)) >= 2 for s in seqs]
    batch = TrainBatch(seqs, masks, [torch.zeros(len(s)) for s in seqs], [1] * len(seqs))
    cfg = load_config(env="bandit", preset="tiny", overrides=["optim.micro_token_budget=24"])
    logprobs = LogProbComputer(cfg, Models(model, None, None, torch.device("cpu")), SUPERVISED)
    micro = list(logprobs.micro_batches(batch, list(range(len(seqs)))))
    assert len(micro) >= 2 and any(len(pb.members) > 1 for pb in micro)
    want = {"eager": dtype, "sdpa": torch.bool, "segments": None}[attn]
    with torch.no_grad():
        alone = [_token_logprobs(model(s[None]).logits, s[None])[0] for s in seqs]
        for pb in micro:
            assert (None if pb.attention_mask is None else pb.attention_mask.dtype) == want
            lp_all = torch.log_softmax(model(**pb.model_inputs()).logits.float(), -1)[0]
            for i, piece in zip(pb.indices, pb.split(lp_all)):
                lp = torch.gather(piece[:-1], -1, seqs[i][1:, None])[:, 0]
                tol = 1e-5 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(lp, alone[i], atol=tol, rtol=tol)
