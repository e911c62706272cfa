"""Parsing a model response ``<think>…</think><answer>…</answer>`` (StarPO's output format).

Two rules (``rollout.format_rule``):

- "ragen" (default): RAGEN's (``ContextManager._parse_response`` in
  ragen/llm_agent/ctx_manager.py, the same at commit 540ab84 and at its head): search the
  text for the first ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (answer-only:
  ``<answer>(.*?)</answer>``), anything around it allowed; take the answer group with the
  tags and ChatML markers removed. No match: no answer, so no action runs.
- "strict": the whole response must be exactly ``<think>…</think> <answer>…</answer>``
  (or ``<answer>…</answer>``), whitespace around the blocks allowed, no stray tag inside
  them; extra text, a second block or a stray tag is a format error. The text of the first
  complete ``<answer>…</answer>`` is still read (its valid actions may run).

Malformed output is a normal event: every function here returns a result, never raises on
any text.
"""
from __future__ import annotations

import dataclasses
import re

_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_ANSWER_ONLY = re.compile(r"\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_ANSWER_ANY = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# RAGEN's search patterns and the markers it deletes from the matched groups
_RAGEN_THINK_ANSWER = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_RAGEN_REMOVED = _TAGS + ("<|im_start|>", "<|im_end|>")
FORMAT_RULES = ("ragen", "strict")


@dataclasses.dataclass
class ParsedResponse:
    """The pieces of one response.

    think: the reasoning text (None when absent or in answer-only mode).
    answer: the answer text (stripped), or None when there is none (see the rules in the
        module docstring).
    format_ok: the response has the required form under the rule ("ragen": the pattern is
        found; "strict": the whole response is the pattern). Valid actions are checked
        separately.
    """

    think: str | None
    answer: str | None
    format_ok: bool


def parse_response(text: str, think: bool = True, rule: str = "ragen") -> ParsedResponse:
    """Parse one response text (the generation prime included, end-of-turn token removed).

    text: e.g. "<think>go down</think> <answer>Down || Right</answer>".
    think: True for the thinking format, False for the answer-only format.
    rule: "ragen" (default) or "strict", see the module docstring.
    Returns a ParsedResponse; never raises on any text (non-str input gives an empty
    result). Raises ValueError for an unknown rule.
    """
    if rule not in FORMAT_RULES:
        raise ValueError(f"format rule must be one of {FORMAT_RULES}, got {rule!r}")
    if not isinstance(text, str):
        return ParsedResponse(None, None, False)
    if rule == "ragen":
        m = (_RAGEN_THINK_ANSWER if think else _ANSWER_ANY).search(text)
        if m is None:
            return ParsedResponse(None, None, False)
        th, ans = m.groups() if think else ("", m.group(1))
        for marker in _RAGEN_REMOVED:
            th, ans = th.replace(marker, "").strip(), ans.replace(marker, "").strip()
        return ParsedResponse(th if think else None, ans, True)
    m = (_THINK_ANSWER if think else _ANSWER_ONLY).fullmatch(text)
    if m is not None:
        parts = m.groups()
        if not any(tag in p for p in parts for tag in _TAGS):
            th, ans = (parts[0].strip(), parts[1].strip()) if think else (None, parts[0].strip())
            return ParsedResponse(th, ans, True)
    a = _ANSWER_ANY.search(text)
    return ParsedResponse(None, a.group(1).strip() if a else None, False)


def cut_at_stop(text: str, stop_strings) -> str:
    """`text` up to and including the first occurrence of any of `stop_strings` (unchanged
    when none occurs), as vLLM and SGLang return it: the token that completes a stop string
    may carry more characters (SmolLM2's ``>.`` after ``</answer``), which are dropped here
    from the text that is parsed, never from the sampled token ids."""
    found = [(i, -len(s)) for s in stop_strings if s and (i := text.find(s)) >= 0]
    if not found:
        return text
    start, neg_len = min(found)
    return text[:start - neg_len]
