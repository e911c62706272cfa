"""Response parsing, prompt/template pieces, sampling filters and rollout config checks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpo.rollout import RolloutConfig, SamplingParams, parse_response, sample_tokens
from fastpo.rollout.prompts import ChatFormat, answer_example, first_user_message, next_user_message
from fastpo.rollout.sampling import filter_logits


# -- parsing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,think,answer,ok", [
    ("<think>go down</think> <answer>Down || Right</answer>", True, "Down || Right", True),
    ("<think>\nhmm\n</think>\n<answer> Up </answer>\n", True, "Up", True),
    ("<think>x</think><answer></answer>", True, "", True),  # empty answer: no action, caught by the env check
    ("<think>x</think>", True, None, False),
    ("<think>x</think> <answer>Up", True, None, False),
    ("<think>x <answer>Up</answer>", True, "Up", False),  # answer readable, structure broken
    ("<think>x</think> <answer>Up</answer> and more", True, "Up", False),
    ("<think>a</think><think>b</think><answer>Up</answer>", True, "Up", False),
    ("<think>x</think> <answer><answer>Up</answer>", True, "<answer>Up", False),
    ("<answer>Left</answer>", False, "Left", True),
    ("<think>x</think><answer>Left</answer>", False, "Left", False),
    ("", True, None, False),
])
def test_parse_response_strict(text, think, answer, ok):
    p = parse_response(text, think=think, rule="strict")
    assert p.answer == answer
    assert p.format_ok is ok
    if ok and think:
        assert p.think is not None


# RAGEN's rule, worked out by hand from its parse (a regex search for the first
# <think>(.*?)</think>\s*<answer>(.*?)</answer>, lazy groups; tags and ChatML markers deleted
# from the groups, which are stripped): the same cases as above, and more
@pytest.mark.parametrize("text,think,answer,ok", [
    ("<think>go down</think> <answer>Down || Right</answer>", True, "Down || Right", True),
    ("<think>\nhmm\n</think>\n<answer> Up </answer>\n", True, "Up", True),
    ("<think>x</think><answer></answer>", True, "", True),
    ("<think>x</think>", True, None, False),
    ("<think>x</think> <answer>Up", True, None, False),
    ("<think>x <answer>Up</answer>", True, None, False),  # no </think>: no match, so no answer at all
    ("<think>x</think> <answer>Up</answer> and more", True, "Up", True),  # text around the pattern is fine
    ("<think>a</think><think>b</think><answer>Up</answer>", True, "Up", True),  # think = "a</think><think>b"
    ("<think>x</think> <answer><answer>Up</answer>", True, "Up", True),  # the inner tag is deleted
    ("<think>a</think><answer>Up</answer><think>b</think><answer>Down</answer>", True, "Up", True),  # the first
    ("<think>a</think> x <answer>Up</answer>", True, None, False),  # only whitespace may separate the blocks
    ("<think>a</think> <answer> Up <|im_end|></answer>", True, "Up", True),
    ("<answer>Left</answer>", False, "Left", True),
    ("<think>x</think><answer>Left</answer>", False, "Left", True),  # answer-only mode searches for the answer
    ("no tags", False, None, False),
    ("", True, None, False),
])
def test_parse_response_ragen(text, think, answer, ok):
    p = parse_response(text, think=think, rule="ragen")
    assert (p.answer, p.format_ok) == (answer, ok)
    assert parse_response(text, think=think) == p  # the default rule


def test_parse_response_ragen_think_group():
    assert parse_response("<think>a</think><think>b</think><answer>Up</answer>").think == "ab"
    with pytest.raises(ValueError, match="lenient"):
        parse_response("<think>x</think><answer>Up</answer>", rule="lenient")


def test_cut_at_stop():
    from fastpo.rollout.parsing import cut_at_stop

    assert cut_at_stop("<answer> Right </answer>.", ("</answer>",)) == "<answer> Right </answer>"
    assert cut_at_stop("<answer>Up</answer></answer>", ("</answer>",)) == "<answer>Up</answer>"
    assert cut_at_stop("<answer>Up</answ", ("</answer>",)) == "<answer>Up</answ"
    assert cut_at_stop("a</answer>.", ()) == "a</answer>."
    assert cut_at_stop("xSTOPy END", ("END", "STOP")) == "xSTOP"


def test_parse_response_non_string():
    for rule in ("ragen", "strict"):
        p = parse_response(None, rule=rule)  # type: ignore[arg-type]
        assert p.answer is None and not p.format_ok


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/thinkanswer |\nUpDown")), max_size=80), st.booleans(),
       st.sampled_from(["ragen", "strict"]))
def test_parse_response_never_raises(text, think, rule):
    p = parse_response(text, think=think, rule=rule)
    if p.format_ok:
        assert p.answer is not None and "<answer>" not in p.answer


# -- prompts ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from fastpo.model_loading import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def test_chat_format_pieces_match_template(tokenizer):
    chat = ChatFormat(tokenizer, think=True, system_prompt="SYS")
    assert chat.prime == "<think>"
    assert chat.template_eot_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    user0 = first_user_message("Rules.", "P_\n_G", 10, 5, True, 32)
    assert "at most" not in user0 and "up to 5 action(s)" in user0 and "10 actions left" in user0
    assert "<think> [your thoughts] </think> <answer> [your answer] </answer>" in user0
    ids = chat.prompt_ids(user0)
    expect = tokenizer.apply_chat_template(chat.messages(user0), tokenize=False, add_generation_prompt=True) + "<think>"
    assert tokenizer.decode(ids) == expect
    user1 = next_user_message(2, -0.1, "P_\n_G", 9, True, 32, note="Invalid actions: Jump.")
    assert user1.startswith("Reward: -0.1\nInvalid actions: Jump.\nTurn 2:")
    full = tokenizer.apply_chat_template(
        chat.messages(user0) + [{"role": "assistant", "content": "<think>A</think><answer>Up</answer>"},
                                {"role": "user", "content": user1}], tokenize=False, add_generation_prompt=True)
    between = full.split("<answer>Up</answer>", 1)[1] + "<think>"
    assert chat.between_turn_text(user1, model_emitted_eot=False) == between
    assert chat.between_turn_text(user1, model_emitted_eot=True) == between[len("<|im_end|>"):]
    assert chat.between_turn_ids(user1, False) == tokenizer(between, add_special_tokens=False)["input_ids"]
    assert ChatFormat(tokenizer, think=False).prime == "<answer>"
    assert "<think>" not in first_user_message("R", "S", 3, 1, False)


# -- sampling --------------------------------------------------------------------------------
def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    # nucleus 0.8: 0.5 + 0.3 reaches it, the rest goes
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.1)).tolist() == [[False, True, True, True]]


def test_sample_tokens_logprobs_and_reproducibility():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=g)
    p = SamplingParams(temperature=0.7, top_k=10, top_p=0.9)
    t1, lp1 = sample_tokens(logits, p, torch.Generator().manual_seed(5))
    t2, lp2 = sample_tokens(logits, p, torch.Generator().manual_seed(5))
    assert torch.equal(t1, t2) and torch.equal(lp1, lp2)
    assert lp1.dtype == torch.float32
    ref = torch.log_softmax(logits / 0.7, -1).gather(1, t1[:, None])[:, 0]
    torch.testing.assert_close(lp1, ref)
    allowed = torch.topk(logits, 10, dim=-1).indices
    assert (allowed == t1[:, None]).any(1).all()
    tg, lpg = sample_tokens(logits, SamplingParams(temperature=0))
    assert torch.equal(tg, logits.argmax(-1))
    assert math.isclose(float(lpg[0]), float(torch.log_softmax(logits[0], -1).max()), rel_tol=1e-6)


def test_sampling_distribution_matches_temperature():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3)
    tok, _ = sample_tokens(logits, SamplingParams(temperature=2.0), torch.Generator().manual_seed(1))
    freq = torch.bincount(tok, minlength=3).float() / tok.numel()
    torch.testing.assert_close(freq, torch.softmax(torch.tensor([0.0, 0.5, 1.0]), 0), atol=0.02, rtol=0)


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_context=1), "max_context"),
])
def test_sampling_params_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,match", [
    (dict(max_turns=0), "max_turns"), (dict(max_new_tokens=1.5), "max_new_tokens"), (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"), (dict(format_penalty="x"), "format_penalty"),
])
def test_rollout_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kw)


def test_first_message_example_uses_the_games_own_action_names():
    # Bandit has no "Up": an example naming it is what small models copy.
    msg = first_user_message("Rules.", "S", 1, 1, True, 32, action_names=["Phoenix", "Dragon"])
    assert "<answer> Phoenix </answer>" in msg and "Up" not in msg
    msg = first_user_message("Rules.", "S", 10, 5, True, 32, action_names=["Left", "Down", "Right", "Up"])
    assert "<answer> Left || Down </answer>" in msg


def test_first_message_example_one_action_per_turn_shows_each_choice_last():
    # One action per turn (Bandit): each arm as its own answer, none favoured, no '||' rule;
    # the example is the message's last words, right before the response.
    msg = first_user_message("Rules.", "S", 1, 1, False, 12, action_names=["Phoenix", "Dragon"])
    assert msg.endswith("For example: <answer> Phoenix </answer> or <answer> Dragon </answer>")
    assert "||" not in msg and "one action per turn" in msg
    assert msg.index("State:\nS") < msg.index("Always output: <answer> [your answer] </answer>") < msg.index("For example")
    msg = first_user_message("Rules.", "S", 10, 5, True, 32, action_names=["Left", "Down", "Right", "Up"])
    assert msg.endswith("For example: <answer> Left || Down </answer>") and "separated by ' || '" in msg
    assert answer_example(["Up"], 1) == "<answer> Up </answer>"


def test_answer_only_mode_does_not_ask_for_thinking():
    from fastpo.model_loading import load_tokenizer
    from fastpo.rollout.prompts import SYSTEM_PROMPT, SYSTEM_PROMPT_NO_THINK, ChatFormat

    tok = load_tokenizer("smollm2-135m-instruct")
    assert ChatFormat(tok, think=True).system_prompt == SYSTEM_PROMPT
    assert ChatFormat(tok, think=False).system_prompt == SYSTEM_PROMPT_NO_THINK
    assert "think" not in SYSTEM_PROMPT_NO_THINK.lower()
    assert ChatFormat(tok, think=False, system_prompt="custom").system_prompt == "custom"


def test_categorical_draws_each_token_with_its_probability():
    """The inverse-CDF draw over blocks: a vocabulary that is not a multiple of the block, the
    mass spread over several blocks, zero-probability tokens (also at both ends) never drawn,
    and the frequencies those of the probabilities (chi-square, 200k draws)."""
    from fastpo.rollout.sampling import CDF_BLOCK, categorical

    V = 3 * CDF_BLOCK + 17
    p = torch.zeros(V, dtype=torch.float64)
    nz = torch.tensor([1, 5, CDF_BLOCK - 1, CDF_BLOCK, 2 * CDF_BLOCK + 3, V - 2])
    p[nz] = torch.tensor([0.05, 0.25, 0.1, 0.3, 0.2, 0.1], dtype=torch.float64)
    n = 200_000
    probs = (p / p.sum()).float().expand(n, V)
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tok = categorical(probs, u)
    counts = torch.bincount(tok, minlength=V).double()
    assert counts[p == 0].sum() == 0
    expected = n * p[nz] / p.sum()
    chi2 = float(((counts[nz] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, chi2  # 5 degrees of freedom: p = 0.001


def test_categorical_ends_of_the_unit_interval():
    """u = 0 draws the first token of positive probability, u just below 1 the last one."""
    from fastpo.rollout.sampling import categorical

    probs = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]]).expand(2, 6)
    u = torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64)
    assert categorical(probs, u).tolist() == [2, 4]
    # a token whose probability underflowed to 0 at the end of the vocabulary is not drawn either
    tiny = torch.tensor([[1e-30, 1.0, 0.0]])
    assert categorical(tiny, torch.tensor([1.0 - 2 ** -53], dtype=torch.float64)).tolist() == [1]


def test_stream_draws_do_not_depend_on_the_other_rows():
    """sample_tokens_by_stream: an env group's tokens are the same alone or beside other groups."""
    from fastpo.rollout.sampling import sample_tokens_by_stream

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0)

    def streams(seeds):
        return {k: torch.Generator().manual_seed(s) for k, s in seeds.items()}

    g = streams({"a": 1, "b": 2})
    both, _ = sample_tokens_by_stream(logits[:4], p, [g["a"], g["b"], g["a"], g["b"]], [0, 1, 2, 3])
    g = streams({"a": 1})
    alone, _ = sample_tokens_by_stream(logits[[0, 2]], p, [g["a"], g["a"]], [0, 2])
    assert both[[0, 2]].tolist() == alone.tolist()


def test_non_finite_logits_are_refused_naming_the_rows():
    """A row of NaN or infinite logits (a diverged model) is a ValueError naming the row, as
    torch.multinomial refused it before, not an index error from the search."""
    from fastpo.rollout.sampling import sample_tokens

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("inf")
    logits[2] = float("nan")
    with pytest.raises(ValueError, match=r"row\(s\) \[1, 2\] of 3 have no finite positive probability mass"):
        sample_tokens(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    tok, _ = sample_tokens(logits[:1], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert 0 <= int(tok) < 300
