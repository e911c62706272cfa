"""The native engine: KV cache across turns, group prefix sharing, per-row stop, context limit.

The mechanics run on a small random Llama (fast); exactness against plain forward passes
and ``model.generate`` runs on the embedded SmolLM2 model.
"""
from __future__ import annotations

import pytest
import torch

from fastpo.model_loading import load_model_and_tokenizer
from fastpo.rollout import NativeEngine, SamplingParams
from fastpo.rollout.kv_cache import shared_prefix_length


@pytest.fixture(scope="module")
def tiny():
    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=0)
    return model, tok


@pytest.fixture(scope="module")
def smol():
    model, tok, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    return model, tok


def _full_logprobs(model, ids, temperature):
    """Log-probs of ids[1:] from one plain forward over the whole sequence (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _run_turns(engine, prompts, group_size, appends, params, seed=0):
    """Drive the engine for len(appends) + 1 turns; returns per-session token lists and logprob lists."""
    B = len(prompts) * group_size
    seqs = {s: list(prompts[s // group_size]) for s in range(B)}
    lps = {s: [None] * len(seqs[s]) for s in range(B)}
    gen = torch.Generator().manual_seed(seed)
    engine.start(prompts, group_size)
    sessions, app = list(range(B)), None
    outs_all = []
    for turn in range(len(appends) + 1):
        outs = engine.generate(sessions, app, params, gen)
        outs_all.append(outs)
        for s, o in zip(sessions, outs):
            seqs[s] += o.token_ids
            lps[s] += o.logprobs
        if turn == len(appends):
            break
        app = [appends[turn][s % len(appends[turn])] for s in sessions]
        for s, a in zip(sessions, app):
            seqs[s] += a
            lps[s] += [None] * len(a)
    engine.finish()
    return seqs, lps, outs_all


def _check_logprobs(model, seqs, lps, temperature, atol):
    for s, ids in seqs.items():
        ref = _full_logprobs(model, ids, temperature)
        idx = [t for t in range(1, len(ids)) if lps[s][t] is not None]
        assert idx, "no sampled tokens"
        got = torch.tensor([lps[s][t] for t in idx])
        torch.testing.assert_close(got, ref[torch.tensor(idx) - 1], atol=atol, rtol=0)


def test_logprobs_match_full_forward_across_turns_and_ragged_stops(tiny):
    model, tok = tiny
    eng = NativeEngine(model, tok)
    prompts = [tok("Hello world, a first prompt")["input_ids"], tok("A second, longer prompt for group two!")["input_ids"]]
    # Half the vocabulary stops a row: rows end at different steps, leaving the batch one by one.
    params = SamplingParams(temperature=0.8, max_new_tokens=12, stop_token_ids=tuple(range(0, 49152, 2)), max_context=512)
    appends = [[[11, 12, 13], [14], [15, 16, 17, 18, 19]], [[20], [21, 22]]]
    seqs, lps, outs = _run_turns(eng, prompts, 3, appends, params)
    reasons = {o.stop_reason for turn in outs for o in turn}
    assert reasons <= {"eot", "length"} and "eot" in reasons
    lengths = {len(o.token_ids) for turn in outs for o in turn}
    assert len(lengths) > 1  # ragged stops were exercised
    _check_logprobs(model, seqs, lps, 0.8, atol=2e-5)


def test_group_prefix_shared_and_only_new_tokens_prefilled(tiny):
    model, tok = tiny
    eng = NativeEngine(model, tok)
    prompts = [list(range(100, 140)), list(range(200, 230))]
    params = SamplingParams(temperature=1.0, max_new_tokens=4, max_context=512)
    eng.start(prompts, 4)
    assert eng.stats["prefilled_tokens"] == 70  # each group prompt once, not 4 times
    eng.generate(list(range(8)), None, params, torch.Generator().manual_seed(0))
    assert eng.stats["prefilled_tokens"] == 70 and eng.stats["generated_tokens"] == 32
    eng.generate(list(range(8)), [[1, 2, 3]] * 8, params, torch.Generator().manual_seed(1))
    # each session: its last sampled token (not yet fed) + the 3 appended tokens
    assert eng.stats["prefilled_tokens"] == 70 + 8 * 4
    assert all(eng.session_length(s) == len(prompts[s // 4]) + 4 + 3 + 4 for s in range(8))
    eng.finish()


def test_prefix_shared_by_all_prompts_prefilled_once(tiny):
    """The prompts' common prefix is prefilled once for all of them, with the same log-probs."""
    model, tok = tiny
    eng = NativeEngine(model, tok)
    head = list(range(300, 340))  # 40 shared tokens, like a system prompt
    prompts = [head + list(range(100, 110)), head + list(range(200, 203)), head + [7]]
    assert shared_prefix_length(prompts) == 40
    assert shared_prefix_length([head + [1], head + [1]]) == 40  # a whole prompt: keep one token per row
    assert shared_prefix_length([head[:10] + [1], head[:10] + [2]]) == 0  # too short to be worth it
    assert shared_prefix_length([head]) == 0
    params = SamplingParams(temperature=0.9, max_new_tokens=6, max_context=512)
    seqs, lps, _ = _run_turns(eng, prompts, 2, [[[5, 6], [8], [9, 10, 11]], [[12], [13], [14]]], params)
    _check_logprobs(model, seqs, lps, 0.9, atol=2e-5)
    eng.reset_stats()
    eng.start(prompts, 2)
    assert eng.stats["prefilled_tokens"] == 40 + 10 + 3 + 1
    eng.finish()


def test_finished_rows_leave_the_batch(tiny):
    """Stopped rows leave the decode batch at once; the decode counters count what is left."""
    model, tok = tiny
    eng = NativeEngine(model, tok)
    sizes = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        eng.start([list(range(100, 120))], 6)
        params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=tuple(range(0, 49152, 3)), max_context=512)
        outs = eng.generate(list(range(6)), None, params, torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    lens = [len(o.token_ids) for o in outs]
    assert len(set(lens)) > 1
    assert sizes[0] == (1, 20)  # the shared prompt, prefilled once
    # decode forward k feeds exactly the rows that sampled k+1 tokens without stopping, one
    # token each, packed into one row
    assert all(s[0] == 1 for s in sizes)
    decode_rows = [s[1] for s in sizes[1:]]
    assert decode_rows == [sum(1 for n in lens if n > k + 1) for k in range(max(lens) - 1)]
    # stats' decode counters (bench/limits.py divides by them): one step per one-token forward,
    # its live rows, the KV columns they read (20 prompt columns + the k + 1 tokens sampled since)
    st = eng.stats
    assert st["decode_steps"] == len(decode_rows) and st["decode_rows"] == sum(decode_rows)
    assert st["decode_kv_columns"] == sum(r * (21 + k) for k, r in enumerate(decode_rows))
    assert st["generated_tokens"] == 6 + st["decode_rows"] == sum(lens)
    assert st["prefill_seconds"] > 0 and st["decode_seconds"] > 0
    assert st["prefill_seconds"] + st["decode_seconds"] <= st["seconds"]
    eng.reset_stats()
    assert eng.stats["decode_steps"] == 0 and eng.stats["decode_seconds"] == 0.0


def test_reproducible_and_seed_dependent(tiny):
    model, tok = tiny
    eng = NativeEngine(model, tok)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=8, max_context=512)
    prompts = [list(range(300, 320)), list(range(400, 410))]
    a = _run_turns(eng, prompts, 2, [[[5, 6]]], params, seed=7)[0]
    b = _run_turns(eng, prompts, 2, [[[5, 6]]], params, seed=7)[0]
    c = _run_turns(eng, prompts, 2, [[[5, 6]]], params, seed=8)[0]
    assert a == b and a != c


def test_context_limit_truncates_without_crashing(tiny):
    model, tok = tiny
    eng = NativeEngine(model, tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=50, max_context=40)
    eng.start([list(range(100, 130)), list(range(100, 105))], 1)
    outs = eng.generate([0, 1], None, params, torch.Generator().manual_seed(0))
    assert outs[0].stop_reason == "context" and len(outs[0].token_ids) == 10
    assert outs[1].stop_reason == "context" and len(outs[1].token_ids) == 35
    assert eng.session_length(0) == 40
    outs2 = eng.generate([0, 1], [[1, 2], [3]], params, torch.Generator().manual_seed(0))
    assert [o.stop_reason for o in outs2] == ["context", "context"] and outs2[0].token_ids == []
    with pytest.raises(ValueError, match="sessions"):  # refused sessions are closed
        eng.generate([0], None, params)
    # a session with room left keeps going while a full one is refused in the same call
    eng.start([list(range(100, 130)), list(range(100, 105))], 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, max_context=40)
    eng.generate([0, 1], None, params, torch.Generator().manual_seed(0))
    outs3 = eng.generate([0, 1], [list(range(20)), [7]], params, torch.Generator().manual_seed(0))
    assert outs3[0].stop_reason == "context" and outs3[0].token_ids == []
    assert outs3[1].stop_reason == "length" and len(outs3[1].token_ids) == 4
    assert eng.session_length(1) == 5 + 4 + 1 + 4
    with pytest.raises(ValueError, match="sessions"):
        eng.generate([5], None, params)


def test_stop_kinds_on_a_scripted_model(tiny):
    """Each stop kind on purpose: the stop string completed inside a token (">." closes
    "</answer>"), and exactly at max_new_tokens (stop_string wins over length); a ">" that
    completes nothing; the end-of-turn token; max_new_tokens. Then the next turn feeds the
    pending stop token and the append, at the right positions."""
    from scripted_logits import ScriptedLogits

    model, tok = tiny

    def enc(text):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, (text, ids)
        return ids[0]

    right, down, up, left, a, b = (enc(x) for x in (" Right", " Down", " Up", " Left", " a", " b"))
    close_open, answer, gt_dot, gtgt, eot = enc(" </"), enc("answer"), enc(">."), enc(">>"), enc("<|im_end|>")
    p0, p1, p2 = 100, 101, 102  # the prompts' last tokens pick each group's script
    table = {p0: (right, down), right: close_open, down: close_open, close_open: answer, answer: gt_dot,
             p1: up, up: gtgt, gtgt: eot,
             p2: left, left: a, a: b, b: a}
    script = ScriptedLogits(model, table, default=eot)
    try:
        eng = NativeEngine(model, tok)
        params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(eot,), stop_strings=("</answer>",),
                                max_context=512)
        prompts = [[1, 2, 3, p0], [4, 5, p1], [6, 7, 8, 9, p2]]
        eng.start(prompts, 2)
        outs = eng.generate(list(range(6)), None, params, torch.Generator().manual_seed(0))
        want = {0: "stop_string", 1: "eot", 2: "length"}
        for s, o in enumerate(outs):
            assert o.stop_reason == want[s // 2], (s, o)
        for s in (0, 1):  # the response ends on the token that completes "</answer>", 4 = max_new_tokens
            assert outs[s].token_ids[1:] == [close_open, answer, gt_dot] and outs[s].token_ids[0] in (right, down)
            assert tok.decode(outs[s].token_ids).endswith("</answer>.")
            assert outs[s].logprobs[0] == pytest.approx(-0.6931472, abs=1e-6)  # one of two: log(1/2)
            assert outs[s].logprobs[1:] == [0.0, 0.0, 0.0]
        assert {outs[0].token_ids[0], outs[1].token_ids[0]} <= {right, down}
        assert outs[2].token_ids == outs[3].token_ids == [up, gtgt, eot]  # ">>" holds ">" but closes nothing
        assert outs[4].token_ids == [left, a, b, a]
        # turn 2: each session feeds its pending last token, then the append, then decodes
        script.fed.clear()
        app = [[p0], [p0], [11, p1], [11, p1], [12, 13, p2], [12, 13, p2]]
        lens = [eng.session_length(s) for s in range(6)]
        outs2 = eng.generate(list(range(6)), app, params, torch.Generator().manual_seed(1))
        assert [o.stop_reason for o in outs2] == [want[s // 2] for s in range(6)]
        first = script.fed[0]  # the turn's chunk forward: rows in session order
        for s in range(6):
            pending = outs[s].token_ids[-1]
            expect = [(lens[s] - 1 + k, t) for k, t in enumerate([pending] + app[s])]
            assert first[s] == expect, (s, first[s], expect)
    finally:
        script.close()
    eng.finish()


def test_refuses_sliding_window_and_out_of_vocabulary_appends(tiny):
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastpo.rollout.kv_cache import unsupported_attention

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64, vocab_size=64)
    qwen_sw = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1, **small)
    mistral_sw = AutoConfig.for_model("mistral", sliding_window=16, **small)
    assert "sliding_attention" in unsupported_attention(qwen_sw)
    assert unsupported_attention(AutoConfig.for_model("qwen2", **small)) is None  # Qwen2.5's default: no window
    assert unsupported_attention(AutoConfig.for_model("mistral", **dict(small, sliding_window=None))) is None
    model, tok = tiny
    assert unsupported_attention(model.config) is None
    for cfg in (qwen_sw, mistral_sw):
        with pytest.raises(ValueError, match="full attention.*(sliding_attention|sliding_window=16)"):
            NativeEngine(AutoModelForCausalLM.from_config(cfg), tok)
    eng = NativeEngine(model, tok)
    eng.start([list(range(100, 110))], 2)
    params = SamplingParams(max_new_tokens=2, max_context=64)
    eng.generate([0, 1], None, params)
    with pytest.raises(ValueError, match=r"session 1 .*outside \[0, 49152\): \[49152\]"):
        eng.generate([0, 1], [[5], [7, 49152]], params)
    with pytest.raises(ValueError, match="outside"):
        eng.generate([0, 1], [[-1], []], params)
    eng.finish()


def test_training_flag_restored_and_no_grad(tiny):
    model, tok = tiny
    model.train()
    eng = NativeEngine(model, tok)
    eng.start([list(range(100, 110))], 2)
    outs = eng.generate([0, 1], None, SamplingParams(max_new_tokens=3, max_context=64))
    assert model.training
    assert all(isinstance(x, float) for o in outs for x in o.logprobs)
    model.eval()


@pytest.mark.slow
def test_greedy_matches_hf_generate_and_logprobs_on_embedded_model(smol):
    model, tok = smol
    eng = NativeEngine(model, tok)
    msgs = [[{"role": "user", "content": "Name three colours."}], [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in msgs]
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(tok.eos_token_id,), max_context=1024)
    eng.start(prompts, 2)
    outs = eng.generate([0, 1, 2, 3], None, params)
    for s, o in enumerate(outs):
        if s % 2:  # greedy: a group's sessions are identical
            assert o.token_ids == outs[s - 1].token_ids
            continue
        p = prompts[s // 2]
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert o.token_ids == ref[0, len(p):].tolist()
    # a second turn appended to ragged sequences still matches a plain forward
    follow = tok("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=(tok.eos_token_id,), max_context=1024)
    outs2 = eng.generate([0, 1, 2, 3], [follow[1:] if o.stop_reason == "eot" else follow for o in outs], sampled,
                         torch.Generator().manual_seed(0))
    for s in range(4):
        o1, o2 = outs[s], outs2[s]
        ids = prompts[s // 2] + o1.token_ids + (follow[1:] if o1.stop_reason == "eot" else follow) + o2.token_ids
        ref = _full_logprobs(model, ids, 1.0)[-len(o2.token_ids):]
        torch.testing.assert_close(torch.tensor(o2.logprobs), ref, atol=1e-4, rtol=0)
    eng.finish()


def _token_bytes(model) -> int:
    """Bytes of one token's keys and values in every layer (fp32)."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def test_kv_memory_follows_the_tokens_held(tiny):
    """8 env groups x 4 sessions that share a 200-token system prompt, 3 turns of 120 appended
    tokens and responses that mostly stop well before max_new_tokens: the KV memory held is
    at most 1.2x the bytes of the distinct tokens held at the fullest moment (the shared prompt
    counted once), not rows x the longest row + max_new_tokens."""
    model, tok = tiny
    eng = NativeEngine(model, tok)
    head = list(range(1000, 1200))
    prompts = [head + list(range(2000 + 100 * g, 2100 + 100 * g)) for g in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=32, stop_token_ids=tuple(range(0, 49152, 8)),
                            max_context=2048)
    gen = torch.Generator().manual_seed(0)
    eng.start(prompts, 4)
    sessions, app = list(range(32)), None
    for turn in range(3):
        eng.generate(sessions, app, params, gen)
        app = [list(range(3000 + s, 3120 + s)) for s in sessions]
    ends = [eng.session_length(s) for s in sessions]
    eng.finish()
    per_token = _token_bytes(model)
    # the fullest moment is the last turn's end: every session's own tokens, the groups' 100
    # and the head once (a copied partly filled block per session at most)
    distinct = sum(n - 300 for n in ends) + 8 * 100 + 200
    st = eng.stats
    assert st["peak_kv_bytes"] <= 1.2 * (distinct + 32 * 16) * per_token
    assert distinct * per_token <= st["peak_kv_token_bytes"] <= (distinct + 32 * 16) * per_token
    assert st["peak_kv_bytes"] <= 1.2 * st["peak_kv_token_bytes"]
    # what a buffer of 32 rows x (the longest row + max_new_tokens) would hold
    assert 32 * (max(ends) + 32) * per_token > 1.5 * st["peak_kv_bytes"]


def test_a_finished_sessions_memory_serves_the_next_turn(tiny):
    """32 sessions take a turn; then 8 of them go on, one with a long append: the other 24
    sessions' blocks serve it, the KV memory does not grow (nor does it pad the 8 rows to the
    long one)."""
    model, tok = tiny
    eng = NativeEngine(model, tok)
    prompts = [list(range(100 + 300 * g, 400 + 300 * g)) for g in range(32)]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, max_context=4096)
    gen = torch.Generator().manual_seed(1)
    eng.start(prompts, 1)
    eng.generate(list(range(32)), None, params, gen)
    after_one = eng.stats["peak_kv_bytes"]
    outs = eng.generate(list(range(8)), [list(range(5000, 7000))] + [[7]] * 7, params, gen)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert eng.stats["peak_kv_bytes"] == after_one
    assert [eng.session_length(s) for s in range(8)] == [300 + 8 + 2000 + 8] + [300 + 8 + 1 + 8] * 7
    eng.finish()
