"""`rollout.context_window: K` (RAGEN's limited_multi_turn): the sampler evicts turn j-K's KV
entries before turn j, keeping positions, and the trainer scores each turn with the context the
sampler saw (fastpo/rollout/window.py). Tiny random model, Sokoban / FrozenLake, 5 turns."""
from __future__ import annotations
import pathlib

import pytest
import torch
from rich.console import Console

import fastpo.rollout.window as ctxwin
from fastpo.config import RolloutConfig, load_config
from fastpo.config.fields import ConfigError
from fastpo.model_loading import load_model_and_tokenizer
from fastpo.packing import pack_micro_batch
from fastpo.rollout import MultiTurnRollout, NativeEngine
from fastpo.trainer import Trainer
from fastpo.trainer.batch import TrainBatch


@pytest.fixture(scope="module")
def tiny():
    model, tok, _ = load_model_and_tokenizer("random:tiny-llama", seed=0)
    return model, tok


def _trainer(tmp_path, *overrides, env="sokoban"):
    cfg = load_config(env=env, preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "trainer.plots=false",
        "trainer.eval_every=0", "rollout.max_turns=5", "rollout.max_new_tokens=16", "rollout.env_groups=2",
        "rollout.group_size=2", *overrides])
    tr = Trainer(cfg, console=Console(quiet=True))
    tr.setup()
    return tr


def _scored(tr, batch, labels=True):
    record = TrainBatch.from_rollout(batch, 1)
    if not labels:
        record.context_turns = record.visible_from = None
    masks = record.loss_mask
    old, *_ = tr.parts.logprobs.compute_old(record)
    allm = torch.cat(masks)
    samp = torch.cat([torch.as_tensor(x) for x in batch.sample_logprobs])
    return float((torch.cat(old) - samp)[allm].abs().max()), record, masks


# -- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -2, "2", "half", "Full", 2.5, True, None])
def test_bad_values_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="context_window") as e:
        RolloutConfig(context_window=bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("text", ["0", "-1", "half", "2.5", "true"])
def test_bad_override_is_a_config_error(text):
    with pytest.raises(ConfigError, match="rollout.context_window") as e:
        load_config(env="sokoban", preset="tiny", overrides=[f"rollout.context_window={text}"])
    assert text.replace("true", "True") in str(e.value)


def test_good_values_and_unsupported_combinations():
    assert load_config(env="sokoban", preset="tiny").rollout.context_window == "full"
    assert load_config(env="sokoban", preset="tiny", overrides=["rollout.context_window=3"]).rollout.context_window == 3
    with pytest.raises(ConfigError, match="reuse"):
        load_config(env="sokoban", preset="tiny", overrides=["rollout.context_window=2", "rollout.reuse=2"])


# -- sampler ------------------------------------------------------------------------------------
class _Recording(NativeEngine):
    """Records, after every generate call, each session's KV context (ids, positions)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.contexts = []  # per call: {session: (ids, positions)}

    def generate(self, sessions, append, params, generator=None):
        out = super().generate(sessions, append, params, generator)
        self.contexts.append({s: self.session_context(s) for s in sessions if s in self._cached})
        return out


def _hand_built(tok, batch, b, j, K, prime="<think>"):
    """The context of trajectory b after turn j's response (its last token not fed yet), from
    the chat text: system + first user message, then the last K turns."""
    users, resp = batch.user_messages[b], [r.tolist() for r in batch.responses[b]]
    head = tok.apply_chat_template([{"role": "system", "content": batch_sys(batch)},
                                    {"role": "user", "content": users[0]}], tokenize=False)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    out = enc(head)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for u in range(max(1, j - K + 1), j + 1):
        header = "<|im_start|>assistant\n" + prime if u == 1 else \
            f"<|im_start|>user\n{users[u - 1]}<|im_end|>\n<|im_start|>assistant\n{prime}"
        out += enc(header)
        if u < j:
            out += resp[u - 1] + enc("\n" if resp[u - 1][-1] == eot else "<|im_end|>\n")
        else:
            out += resp[u - 1][:-1]
    return out


def batch_sys(batch):
    from fastpo.rollout.prompts import SYSTEM_PROMPT

    return SYSTEM_PROMPT


@pytest.mark.parametrize("K,eot", [(1, False), (2, False), (1, True)])
def test_the_kv_context_is_the_head_and_the_last_k_turns_exactly(tiny, K, eot, monkeypatch):
    model, tok = tiny
    if eot:  # row 0 of every 4th draw samples the end-of-turn token (a random model never does)
        import fastpo.rollout.engine as engine_mod

        orig, calls = engine_mod.sample_tokens, [0]

        def sample(*a, **k):
            out = orig(*a, **k)
            calls[0] += 1
            if calls[0] % 4 == 0:
                out[0][0] = tok.convert_tokens_to_ids("<|im_end|>")
            return out

        monkeypatch.setattr(engine_mod, "sample_tokens", sample)
    eng = _Recording(model, tok)
    ro = MultiTurnRollout(eng, tok, "sokoban", {}, RolloutConfig(max_turns=5, max_new_tokens=12, context_window=K))
    batch = ro.generate([1, 2], 2, seed=0)
    assert int(batch.num_turns.min()) == 5  # every trajectory ran all turns (a random model never solves)
    for b in range(len(batch)):
        full = batch.input_ids[b].tolist()
        for j in range(1, 6):
            ids, pos = eng.contexts[j - 1][b]
            assert ids == _hand_built(tok, batch, b, j, K), (b, j)
            # positions are the tokens' places in the full trajectory (never shifted)
            assert [full[p] for p in pos] == ids
            last = int(torch.nonzero(batch.turn_index[b] == j - 1).flatten()[-1])  # turn j's last token
            assert pos == sorted(set(pos)) and pos[-1] == last - 1
    assert batch.metrics["peak_kv_bytes"] > 0
    if eot:
        assert "eot" in {r for rs in batch.turn_stop_reasons for r in rs}


def test_refill_baseline_rebuilds_the_same_window_with_fresh_positions(tiny):
    model, tok = tiny
    eng = _Recording(model, tok)
    ro = MultiTurnRollout(eng, tok, "frozenlake", {}, RolloutConfig(max_turns=4, max_new_tokens=12, context_window=2))
    ro.refill_window = True
    batch = ro.generate([5], 2, seed=1)
    assert batch.info["refill_window"] is True and int(batch.num_turns.min()) == 4
    for b in range(len(batch)):
        for j in range(1, 5):
            ids, pos = eng.contexts[j - 1][b]
            assert ids == _hand_built(tok, batch, b, j, 2)
            assert pos == list(range(len(ids)))  # re-prefilled: contiguous positions


def test_a_window_as_long_as_the_episode_is_the_full_path_bit_for_bit(tiny):
    model, tok = tiny
    outs = []
    for cw in ("full", 5):
        ro = MultiTurnRollout(NativeEngine(model, tok), tok, "sokoban", {},
                              RolloutConfig(max_turns=5, max_new_tokens=12, context_window=cw))
        outs.append(ro.generate([3, 4], 2, seed=2))
    a, b = outs
    assert not a.context_turns and b.context_turns and "context_window" not in a.info
    for x, y, lx, ly in zip(a.input_ids, b.input_ids, a.sample_logprobs, b.sample_logprobs):
        assert torch.equal(x, y) and torch.equal(lx, ly)
    for tn, vf in zip(b.context_turns, b.visible_from):  # K = max_turns: nothing fed ever had a hidden turn
        n = tn.numel() - 1  # (the final token is never fed)
        assert torch.equal(ctxwin.window_mask(tn, vf)[:n], torch.ones(n + 1, n + 1, dtype=torch.bool).tril()[:n])


# -- trainer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("env,K,share", [("sokoban", 1, True), ("sokoban", 2, False), ("frozenlake", 3, True)])
def test_trainer_scores_what_the_sampler_saw(tmp_path, env, K, share):
    tr = _trainer(tmp_path, f"rollout.context_window={K}", f"optim.share_prefix={str(share).lower()}", env=env)
    batch = tr.parts.sampler.generate([11, 12], 2, tr.cfg.rollout.temperature, seed=3)
    assert int(batch.num_turns.max()) > K  # some turn had evicted context
    gap, record, masks = _scored(tr, batch)
    assert gap < 1e-4, gap
    # the control: scored with plain causal attention the gap is far above the bound
    record.visible_from = [torch.zeros_like(vf) for vf in record.visible_from]
    old, *_ = tr.parts.logprobs.compute_old(record)
    allm = torch.cat(masks)
    samp = torch.cat([torch.as_tensor(x) for x in batch.sample_logprobs])
    assert float((torch.cat(old) - samp)[allm].abs().max()) > 1e-3


@pytest.mark.parametrize("mode", ["recompute", "sampler"])
def test_an_iteration_in_both_old_logprob_modes(tmp_path, mode):
    tr = _trainer(tmp_path, "rollout.context_window=2", f"algorithm.old_logprob={mode}")
    m = tr.iteration(1)
    assert m["train/old_logprob_from_sampler"] == float(mode == "sampler")
    if mode == "recompute":
        assert m["train/logprob_gap_max"] < 1e-4
    assert m["actor/updates"] >= 1


def test_unlabelled_trajectories_are_refused(tmp_path):
    tr = _trainer(tmp_path, "rollout.context_window=2")
    batch = tr.parts.sampler.generate([11], 2, tr.cfg.rollout.temperature, seed=3)
    with pytest.raises(RuntimeError, match="context-window labels"):
        _scored(tr, batch, labels=False)


# -- the mask -----------------------------------------------------------------------------------
def test_window_mask_by_hand():
    # head (turn 0) x2, turn 1 x2, turn 2 x2; K = 1: turn-2 tokens fed at turn 2 see the head and turn 2
    turn = torch.tensor([0, 0, 1, 1, 2, 2])
    vis = torch.tensor([1, 1, 1, 1, 2, 2])
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(ctxwin.window_mask(turn, vis), want)
    assert torch.equal(ctxwin.window_mask(turn, vis, slice(4, 6)), want[4:])


def test_mask_and_segment_packing_agree_under_a_window(tiny):
    from fastpo.packing import use_segment_attention

    model, tok = tiny
    import copy

    seg = copy.deepcopy(model)
    assert use_segment_attention(seg)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 500, (n,), generator=g) for n in (9, 7)]
    wins = [(torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3]), torch.tensor([1, 1, 1, 1, 1, 2, 2, 3, 3])), None]
    outs = []
    for m, att in ((model, "mask"), (seg, "segments")):
        pb = pack_micro_batch(ids, [0, 1], attention=att, mask_dtype=torch.bool, windows=wins)
        with torch.no_grad():
            outs.append(m.model(**pb.model_inputs(), use_cache=False).last_hidden_state[0])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="varlen"):
        pack_micro_batch(ids, [0, 1], attention="varlen", windows=wins)


def test_bench_part_runs_quick():
    """`bench/throughput.py --part window` end to end at --quick sizes on the tiny model."""
    import os
    import sys

    sys.path.insert(0, os.path.join(str(pathlib.Path(__file__).resolve().parents[2]), "bench"))
    import part_window
    from _common import BenchContext

    recs = part_window.run(BenchContext(quick=True, model="random:tiny-llama", repeats=1, parts=("window",)))
    assert [r.unit for r in recs] == ["bytes", "s", "s", "tokens", "bytes"]
    kv_full, pre_refill = recs[0], recs[3]
    assert kv_full.baseline > kv_full.fastpo > 0  # 6 turns, K = 2: the window holds less than everything
    assert pre_refill.baseline > pre_refill.fastpo > 0  # re-prefilling feeds the kept turns again
    assert "refill:" in kv_full.notes and "peak KV" in kv_full.notes


def test_engine_evict_and_rewind_refuse_bad_calls(tiny):
    from fastpo.rollout import SamplingParams

    model, tok = tiny
    eng = NativeEngine(model, tok)
    eng.start([[1, 2, 3, 4, 5]], 2)
    with pytest.raises(ValueError, match="has not generated yet"):
        eng.evict(0, 1, 3)  # its KV row is still the group's shared prompt row
    eng.generate([0, 1], None, SamplingParams(max_new_tokens=3, max_context=64))
    with pytest.raises(ValueError, match="not open"):
        eng.evict(7, 0, 1)
    with pytest.raises(ValueError, match="lo <= hi"):
        eng.evict(0, 3, 1)
    with pytest.raises(ValueError, match="rewind length"):
        eng.rewind(0, 0)
    ids, pos = eng.session_context(0)
    assert pos == list(range(len(pos))) and ids[:5] == [1, 2, 3, 4, 5]
    eng.evict(0, 1, 3)
    ids2, pos2 = eng.session_context(0)
    assert pos2 == [p for p in pos if not 1 <= p < 3] and ids2 == [ids[p] for p in pos2]
    ids1, pos1 = eng.session_context(1)  # the other session of the group is untouched
    assert ids1[:5] == [1, 2, 3, 4, 5] and pos1 == list(range(len(pos1)))


def test_turn_boundaries_on_the_chat_template(tiny):
    from fastpo.rollout.prompts import ChatFormat

    _, tok = tiny
    chat = ChatFormat(tok)
    special, eot = tok.all_special_ids, chat.eot_token_ids
    for emitted, closing in ((False, "<|im_end|>\n"), (True, "\n")):
        between = chat.between_turn_ids("Turn 2: state", emitted)
        c = ctxwin.closing_length(between, special, eot)
        assert tok.decode(between[:c]) == closing  # closes the previous response
        assert tok.decode(between[c:]).startswith("<|im_start|>user\nTurn 2")
    prompt = chat.prompt_ids("rules and state")
    h = ctxwin.head_length(chat, "rules and state", prompt)
    assert tok.decode(prompt[:h]).endswith("rules and state<|im_end|>\n")
    assert tok.decode(prompt[h:]) == "<|im_start|>assistant\n<think>"
