"""Plain-Python reference implementations of one environment turn: parse the answer
text, step the dynamics, render the text. Readable, slow, and used by the tests to
cross-check the Numba kernels and by the benchmarks as the baseline.
"""
from __future__ import annotations

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def parse_answer(answer: str, names: dict[str, int], max_actions: int) -> tuple[list[int], list[str]]:
    """Parse one answer: pieces split on '||', stripped, empty ones skipped, the first
    `max_actions` looked at, matched ASCII case-insensitively against `names`
    (lower-case name -> action id). Returns (action ids, invalid pieces)."""
    actions, invalid = [], []
    pieces = [p.strip() for p in answer.split("||")]
    pieces = [p for p in pieces if p][:max_actions]
    for p in pieces:
        a = names.get(p.translate(_ASCII_LOWER))
        if a is None:
            invalid.append(p)
        else:
            actions.append(a)
    return actions, invalid
