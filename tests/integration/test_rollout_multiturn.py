"""The multi-turn loop: token-in-token-out on the embedded model, rewards and format
penalties, action budget, truncation, reproducibility."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastpo.rollout import MultiTurnRollout, NativeEngine, RolloutConfig, TurnOutput
from fastpo.rollout.kv_cache import shared_prefix_length


def _runs(mask: torch.Tensor):
    """(start, end, is_model) runs of equal loss-mask values."""
    out, s = [], 0
    m = mask.tolist()
    for t in range(1, len(m) + 1):
        if t == len(m) or m[t] != m[s]:
            out.append((s, t, m[s]))
            s = t
    return out


class _Recorder:
    """Records, during a rollout, what the sampler drew (in draw order) and what every
    forward was fed (real (position, token) pairs), to compare with the batch's records."""

    def __init__(self, model):
        from scripted_logits import ScriptedLogits

        import fastpo.rollout.engine as engine_mod

        self.sampled: list = []
        self._mod, self._orig = engine_mod, engine_mod.sample_tokens
        self.feed = ScriptedLogits(model, None)

        def sample(*a, **k):
            out = self._orig(*a, **k)  # (tokens, logprobs[, entropies])
            self.sampled.extend(out[0].tolist())
            return out

        engine_mod.sample_tokens = sample

    def close(self):
        self._mod.sample_tokens = self._orig
        self.feed.close()


def _generate_recorded(ro, model, *args, **kw):
    rec = _Recorder(model)
    try:
        return ro.generate(*args, **kw), rec
    finally:
        rec.close()


def _check_sampled_and_fed(batch, rec, prompt_lens):
    """The responses are exactly the drawn tokens, and what the model was fed is exactly
    the groups' common prompt prefix once, each group's rest of the prompt once, plus every trajectory's later tokens but its last (still
    pending when the rollout ends), at their true positions. Multisets: the engine batches
    and reorders rows, but any token recorded differently from what was drawn or fed shows."""
    from collections import Counter

    responses = Counter(t for rs in batch.responses for r in rs for t in r.tolist())
    assert Counter(rec.sampled) == responses
    fed = Counter(pt for forward in rec.feed.fed for row in forward for pt in row)
    expect = Counter()
    prompts = []
    for g in torch.unique(batch.group_ids).tolist():
        first = int((batch.group_ids == g).nonzero()[0])
        prompts.append(batch.input_ids[first][:prompt_lens[first]].tolist())
    shared = shared_prefix_length(prompts)  # the groups' common prefix: fed once for all
    expect.update(enumerate(prompts[0][:shared]))
    for p in prompts:
        expect.update((i, p[i]) for i in range(shared, len(p)))
    for i, ids in enumerate(batch.input_ids):
        ids = ids.tolist()
        expect.update((p, ids[p]) for p in range(prompt_lens[i], len(ids) - 1))
    assert fed == expect


@pytest.fixture(scope="module")
def smol_batch(embedded):
    model, tok = embedded
    # On this sampler seed the 12 responses end 9 times at max_new_tokens, twice on the
    # model's own <|im_end|> and once on "</answer>" (seeds 0-7 end on one or two kinds; every
    # kind, on purpose: test_every_stop_kind_on_a_scripted_model_keeps_tokens_and_template).
    cfg = RolloutConfig(max_turns=3, max_new_tokens=16, max_context=2048, temperature=1.0)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, "frozenlake", {"size": 4}, cfg)
    batch, rec = _generate_recorded(ro, model, [0, 1], group_size=2, seed=8)
    return ro, batch, rec


def _check_against_template(ro, tok, batch, i):
    """Trajectory i: one model run per turn holding the sampled ids, and the non-model tokens
    equal to what the chat template renders for the same messages."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids, mask, tix = batch.input_ids[i], batch.loss_mask[i], batch.turn_index[i]
    runs = _runs(mask)
    model_runs = [r for r in runs if r[2]]
    other_runs = [r for r in runs if not r[2]]
    # one run per turn, the turn's recorded response
    assert len(model_runs) == int(batch.num_turns[i]) == len(batch.responses[i]) == len(batch.turn_stop_reasons[i])
    for k, (a, b, _) in enumerate(model_runs):
        assert torch.equal(ids[a:b], batch.responses[i][k])
        assert (tix[a:b] == k).all()
    assert (tix[~mask] == -1).all()
    assert (batch.sample_logprobs[i][~mask] == 0).all()
    # the non-model tokens are what the chat template renders for the same messages
    msgs = ro.chat.messages(batch.user_messages[i][0])
    rendered = [tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + ro.chat.prime]
    bodies, eots = [], []
    for k, resp in enumerate(batch.responses[i]):
        r = resp.tolist()
        eots.append(r[-1] == im_end)
        bodies.append(tok.decode(r[:-1] if eots[-1] else r))
        if k + 1 < len(batch.user_messages[i]):
            msgs = msgs + [{"role": "assistant", "content": ro.chat.prime + bodies[-1]},
                           {"role": "user", "content": batch.user_messages[i][k + 1]}]
            rendered.append(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                            + ro.chat.prime)
    a0, b0, _ = other_runs[0]
    assert ids[a0:b0].tolist() == tok(rendered[0], add_special_tokens=False)["input_ids"]
    for k in range(1, len(rendered)):
        assert rendered[k].startswith(rendered[k - 1] + bodies[k - 1])
        between = rendered[k][len(rendered[k - 1]) + len(bodies[k - 1]):]
        a, b, _ = other_runs[k]
        expect = tok(between, add_special_tokens=False)["input_ids"]
        assert ([im_end] if eots[k - 1] else []) + ids[a:b].tolist() == expect
    assert len(other_runs) == len(rendered)  # nothing after the last response
    assert tok.decode(ids) == rendered[-1] + bodies[-1] + ("<|im_end|>" if eots[-1] else "")
    return eots[:len(rendered) - 1]  # the turns followed by template tokens


def _check_stop_reasons(batch, params, tok):
    """Each turn's recorded stop reason agrees with its ids; returns the kinds seen."""
    seen = set()
    for i in range(len(batch)):
        for r, why in zip(batch.responses[i], batch.turn_stop_reasons[i]):
            r = r.tolist()
            seen.add(why)
            text, before = tok.decode(r), tok.decode(r[:-1])
            if why == "eot":
                assert r[-1] in params.stop_token_ids
            elif why == "stop_string":  # ends on the token that completes "</answer>"
                assert "</answer>" in text and "</answer>" not in before and r[-1] not in params.stop_token_ids
            elif why == "length":
                assert len(r) == params.max_new_tokens and "</answer>" not in text
            else:
                assert why == "context"
    return seen


@pytest.mark.slow
def test_token_in_token_out_matches_chat_template(embedded, smol_batch):
    model, tok = embedded
    ro, batch, rec = smol_batch
    assert len(batch) == 4 and batch.group_ids.tolist() == [0, 0, 1, 1] and batch.seeds.tolist() == [0, 0, 1, 1]
    eots = []
    for i in range(len(batch)):
        eots += _check_against_template(ro, tok, batch, i)
    prompt_lens = [int(m.nonzero()[0]) for m in batch.loss_mask]
    _check_sampled_and_fed(batch, rec, prompt_lens)
    seen = _check_stop_reasons(batch, ro.sampling_params(), tok)
    # real responses ended on the model's own <|im_end|>, at max_new_tokens and on "</answer>"
    assert {"eot", "length", "stop_string"} <= seen, seen


@pytest.mark.slow
def test_sampling_logprobs_match_a_plain_forward(embedded, smol_batch):
    model, tok = embedded
    _, batch, _ = smol_batch
    for i in range(len(batch)):
        ids = batch.input_ids[i]
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float()
        lp = torch.log_softmax(logits / 1.0, -1)[:-1].gather(1, ids[1:, None])[:, 0]
        m = batch.loss_mask[i]
        assert not m[0]
        torch.testing.assert_close(batch.sample_logprobs[i][1:][m[1:]], lp[m[1:]], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_batch_fields_metrics_select(smol_batch):
    _, batch, _ = smol_batch
    B, T = len(batch), 3
    assert batch.turn_rewards.shape == (B, T) and batch.turn_rewards.dtype == torch.float32
    torch.testing.assert_close(batch.scores, batch.turn_rewards.sum(1))
    for i in range(B):
        n = int(batch.num_turns[i])
        assert (batch.turn_rewards[i, n:] == 0).all() and (batch.format_penalty[i, n:] == 0).all()
        assert all(p in (0.0, pytest.approx(-0.1)) for p in batch.format_penalty[i, :n].tolist())
    for key in ("seconds", "prefilled_tokens", "generated_tokens", "tokens_per_s", "response_length",
                "valid_action_rate", "effective_action_rate", "format_penalty_rate", "success_rate"):
        assert key in batch.metrics
    assert batch.metrics["generated_tokens"] == sum(int(m.sum()) for m in batch.loss_mask)
    sub = batch.select([3, 0])
    assert len(sub) == 2 and torch.equal(sub.input_ids[0], batch.input_ids[3]) and sub.group_ids.tolist() == [1, 0]
    assert len(batch.select(torch.tensor([True, False, False, True]))) == 2
    with pytest.raises(IndexError):
        batch.select([4])
    texts = batch.texts()
    assert texts[0].startswith("<|im_start|>system") and "Turn 1:" in texts[0]


def test_every_stop_kind_on_a_scripted_model_keeps_tokens_and_template(tiny):
    """The real engine and loop on a model whose logits follow a script: after the prime each
    response is, at random, " Right </answer>." (ends on ">.", the token completing the stop
    string), " Down<|im_end|>" (the model's own end-of-turn token) or " Left a b a b"
    (max_new_tokens). Every kind must occur, and each trajectory's ids must still be the
    sampled ids plus exactly the chat template's tokens."""
    from scripted_logits import ScriptedLogits

    model, tok = tiny

    def enc(text):
        (i,) = tok(text, add_special_tokens=False)["input_ids"]
        return i

    right, down, left, a, b = (enc(x) for x in (" Right", " Down", " Left", " a", " b"))
    close_open, answer, gt_dot, eot, gt = enc(" </"), enc("answer"), enc(">."), enc("<|im_end|>"), enc(">")
    table = {gt: (right, down, left), right: close_open, close_open: answer, answer: gt_dot, down: eot,
             left: a, a: b, b: a}
    cfg = RolloutConfig(max_turns=3, max_new_tokens=5, max_context=4096, temperature=1.0)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, "frozenlake", {"size": 4}, cfg)
    assert ro.chat.prime.endswith(">")  # the script keys on the prime's last token
    script = ScriptedLogits(model, table, default=eot)
    try:
        batch, rec = _generate_recorded(ro, model, [0, 1], group_size=4, seed=3)
    finally:
        script.close()
    params = ro.sampling_params()
    seen = _check_stop_reasons(batch, params, tok)
    assert seen == {"eot", "stop_string", "length"}
    eots = []
    for i in range(len(batch)):
        eots += _check_against_template(ro, tok, batch, i)
        for r, why, lp in zip(batch.responses[i], batch.turn_stop_reasons[i],
                              _split(batch.sample_logprobs[i], batch.turn_index[i])):
            want = {"stop_string": [right, close_open, answer, gt_dot], "eot": [down, eot],
                    "length": [left, a, b, a, b]}[why]
            assert r.tolist() == want
            # the first token was one of three (log 1/3), the rest forced (log 1)
            torch.testing.assert_close(lp, torch.tensor([-1.0986123] + [0.0] * (len(want) - 1)), atol=1e-6, rtol=0)
    assert any(eots) and not all(eots)  # both template branches after a response
    prompt_lens = [int(m.nonzero()[0]) for m in batch.loss_mask]
    _check_sampled_and_fed(batch, rec, prompt_lens)
    # none of these answers parse: every turn is penalised, per trajectory too
    assert (batch.penalised_turns == batch.num_turns).all() and (batch.valid_actions == 0).all()


def _split(values, turn_index):
    """values of the model tokens, one tensor per turn."""
    turns = turn_index[turn_index >= 0]
    v = values[turn_index >= 0]
    return [v[turns == k] for k in range(int(turns.max()) + 1)] if turns.numel() else []


# -- the loop's reward logic with scripted responses (the env and tokenizer are real) --------
class ScriptedEngine:
    """Replays fixed response texts through the engine's session interface."""

    def __init__(self, tokenizer, scripts):
        self.tok = tokenizer
        self.scripts = scripts  # scripts[session][turn] -> response text (without the prime)
        self.turn = {}
        self.device = torch.device("cpu")
        self.reset_stats()

    def reset_stats(self):
        self.stats = {"prefilled_tokens": 0, "generated_tokens": 0, "seconds": 0.0}

    def start(self, prompts, group_size):
        self.len = {s: len(prompts[s // group_size]) for s in range(len(prompts) * group_size)}
        self.turn = {s: 0 for s in self.len}

    def session_length(self, s):
        return self.len[s]

    def generate(self, sessions, append, params, generator=None):
        outs = []
        for j, s in enumerate(sessions):
            self.len[s] += len(append[j]) if append else 0
            ids = self.tok(self.scripts[s][self.turn[s]], add_special_tokens=False)["input_ids"] + [params.stop_token_ids[0]]
            self.turn[s] += 1
            self.len[s] += len(ids)
            outs.append(TurnOutput(ids, [-0.5] * len(ids), "eot"))
        return outs

    def finish(self):
        pass


@pytest.mark.parametrize("run_valid", [True, False])
def test_rewards_penalties_budget_with_scripted_responses(tiny, run_valid):
    _, tok = tiny
    ok = "x</think> <answer>{}</answer>"
    scripts = [
        [ok.format("Right || Right"), ok.format("Down || Down")],  # reaches the goal in turn 2
        ["x</think> <answer>Right || Jump</answer>", ok.format("Left")],  # invalid action, then valid
        [ok.format("Right || Left || Right || Left || Right"), ok.format("Down")],  # spends the budget of 4
        ["I will go right.", "no tags again"],  # no answer at all, twice
    ]
    cfg = RolloutConfig(max_turns=2, max_actions_per_traj=4, max_actions_per_turn=5,
                        run_valid_actions_on_format_error=run_valid, format_penalty=-0.25)
    env_cfg = {"desc": ["SFF", "FHF", "FFG"], "is_slippery": False}
    ro = MultiTurnRollout(ScriptedEngine(tok, scripts), tok, "frozenlake", env_cfg, cfg)
    batch = ro.generate([7], group_size=4)
    assert batch.stop_reason[0] == "env_done" and bool(batch.success[0])
    assert batch.turn_rewards[0].tolist() == [0.0, 1.0] and batch.num_actions[0] == 4
    # traj 1: penalty in turn 1; Right runs only when run_valid is on
    assert batch.format_penalty[1].tolist() == [-0.25, 0.0]
    assert batch.num_actions[1] == (2 if run_valid else 1)
    assert batch.stop_reason[1] == "max_turns"
    assert "Invalid actions: Jump." in batch.user_messages[1][1]
    # traj 2: 4 of 5 actions run (budget), then the trajectory ends
    assert batch.num_actions[2] == 4 and batch.stop_reason[2] == "action_budget" and batch.num_turns[2] == 1
    assert batch.turn_rewards[2].tolist() == [0.0, 0.0]
    # traj 3: penalised every turn, nothing runs
    assert batch.turn_rewards[3].tolist() == [-0.25, -0.25] and batch.num_actions[3] == 0
    assert batch.metrics["format_penalty_rate"] == pytest.approx(3 / 7)
    # per trajectory: recognised / unrecognised answer pieces, state-changing actions, penalised turns
    assert batch.valid_actions.tolist() == [4, 2, 5, 0]  # traj 2: 5 recognised, 4 run
    assert batch.invalid_actions.tolist() == [0, 1, 0, 0]
    assert batch.penalised_turns.tolist() == [0, 1, 0, 2]
    assert batch.effective_actions[0] == 4 and batch.effective_actions[3] == 0
    v, inv = batch.valid_actions.sum(), batch.invalid_actions.sum()
    assert batch.metrics["valid_action_rate"] == pytest.approx(float(v / (v + inv)))
    # the same rates from the per-trajectory counts (what a concatenation of batches reports)
    from fastpo.rollout.trajectory_batch import count_rates

    rates = count_rates(batch)
    del rates["response_length"]  # tokens per turn: this scripted engine counts no generated tokens
    assert rates == {k: batch.metrics[k] for k in rates} and rates["effective_action_rate"] > 0
    assert batch.turn_stop_reasons == [["eot"] * int(n) for n in batch.num_turns]
    sub = batch.select([3, 1])
    assert sub.penalised_turns.tolist() == [2, 1] and sub.turn_stop_reasons == [batch.turn_stop_reasons[3],
                                                                               batch.turn_stop_reasons[1]]
    torch.testing.assert_close(batch.scores, batch.turn_rewards.sum(1))
    for i in range(4):  # recorded logprobs sit exactly on the model tokens
        assert (batch.sample_logprobs[i][batch.loss_mask[i]] == -0.5).all()


def test_context_truncation_and_answer_only_mode(tiny):
    model, tok = tiny
    eng = NativeEngine(model, tok)
    probe = MultiTurnRollout(eng, tok, "frozenlake", {}, RolloutConfig(think=False, max_new_tokens=8))
    b0 = probe.generate([3], group_size=2, seed=1)
    prompt_len = int((~b0.loss_mask[0]).nonzero()[-1]) if int(b0.num_turns[0]) == 1 else None
    assert tok.decode(b0.input_ids[0][:20].tolist()).startswith("<|im_start|>system")
    first_model = int(b0.loss_mask[0].nonzero()[0])
    assert tok.decode(b0.input_ids[0][:first_model]).endswith("<|im_start|>assistant\n<answer>")
    # room for the prompt and one short response, not for the next observation
    limit = first_model + 10
    cfg = RolloutConfig(max_turns=3, max_new_tokens=8, max_context=limit, think=False)
    batch = MultiTurnRollout(eng, tok, "frozenlake", {}, cfg).generate([3], group_size=2, seed=1)
    assert batch.truncated.all() and batch.stop_reason == ["context", "context"]
    assert (batch.num_turns == 1).all() and all(len(x) <= limit for x in batch.input_ids)
    # a prompt longer than the context: no turn at all, still no crash
    cfg = RolloutConfig(max_turns=2, max_new_tokens=8, max_context=first_model - 5)
    batch = MultiTurnRollout(eng, tok, "frozenlake", {}, cfg).generate([3], group_size=2)
    assert batch.truncated.all() and (batch.num_turns == 0).all() and not any(m.any() for m in batch.loss_mask)
    del prompt_len


def test_reproducible_bandit_single_turn(tiny):
    model, tok = tiny
    eng = NativeEngine(model, tok)
    # the bandit is a single-turn game (the env ends only once an arm is pulled)
    ro = MultiTurnRollout(eng, tok, "bandit", {}, RolloutConfig(max_turns=1, max_new_tokens=6))
    a = ro.generate([0, 1, 2], group_size=2, seed=5)
    b = ro.generate([0, 1, 2], group_size=2, seed=5)
    c = ro.generate([0, 1, 2], group_size=2, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
    assert any(not torch.equal(x, y) for x, y in zip(a.input_ids, c.input_ids))
    assert (a.num_turns == 1).all() and set(a.stop_reason) <= {"env_done", "max_turns"}
    # prefill: 3 group prompts once each (not 6), their common prefix once, nothing else in a
    # single-turn game
    prompts = [x[~m].tolist() for x, m in zip(a.input_ids[::2], a.loss_mask[::2])]
    shared = shared_prefix_length(prompts)
    assert shared > 0 and a.metrics["prefilled_tokens"] == shared + sum(len(p) - shared for p in prompts)


def test_bad_arguments(tiny):
    model, tok = tiny
    eng = NativeEngine(model, tok)
    with pytest.raises(ValueError, match="unknown environment"):
        MultiTurnRollout(eng, tok, "chess", {}, RolloutConfig())
    ro = MultiTurnRollout(eng, tok, "bandit", {}, RolloutConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="group_size"):
        ro.generate([0], group_size=0)
    with pytest.raises(ValueError, match="seeds"):
        ro.generate([-1], group_size=1)
    for bad in ([1.5], ["3"], [True], [], 3, "12", np.array([0.0, 1.0])):  # refused, never truncated
        with pytest.raises(ValueError, match="seeds must be"):
            ro.generate(bad, group_size=1)
    with pytest.raises(ValueError, match="seed"):
        ro.generate([0], group_size=1, seed=0.5)
    ok = ro.generate(np.array([4, 5]), group_size=1, seed=np.int64(2))  # integer arrays are fine
    assert ok.seeds.tolist() == [4, 5]
    with pytest.raises(TypeError, match="RolloutConfig"):
        MultiTurnRollout(eng, tok, "bandit", {}, {"max_turns": 2})
