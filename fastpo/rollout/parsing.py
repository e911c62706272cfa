"""Parsing a model response ``<think>…</think><answer>…</answer>`` (StarPO's output format).

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


@dataclasses.dataclass
class ParsedResponse:
    """The pieces of one response.

    think: the reasoning text (None when absent or in answer-only mode).
    answer: the text inside the first <answer>…</answer> (stripped), or None when there is
        no complete answer block.
    format_ok: the whole response is exactly ``<think>…</think> <answer>…</answer>`` (or
        ``<answer>…</answer>`` in answer-only mode), whitespace around the blocks allowed,
        with no stray tags inside the blocks. Valid actions are checked separately.
    """

    think: str | None
    answer: str | None
    format_ok: bool


def parse_response(text: str, think: bool = True) -> ParsedResponse:
    """Parse one response text (the generation prime included, end-of-turn token removed).

    text: e.g. "<think>go down</think> <answer>Down || Right</answer>".
    think: True for the thinking format, False for the answer-only format.
    Returns a ParsedResponse; never raises (non-str input gives an empty result).
    """
    if not isinstance(text, str):
        return ParsedResponse(None, None, False)
    m = (_THINK_ANSWER if think else _ANSWER_ONLY).fullmatch(text)
    if m is not None:
        parts = m.groups()
        if not any(tag in p for p in parts for tag in _TAGS):
            th, ans = (parts[0].strip(), parts[1].strip()) if think else (None, parts[0].strip())
            return ParsedResponse(th, ans, True)
    a = _ANSWER_ANY.search(text)
    return ParsedResponse(None, a.group(1).strip() if a else None, False)
