"""Numeric helpers shared by the metrics, the end-of-run tables and the plots."""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def standard_error(xs) -> float:
    """Standard error of the mean of `xs`: sample std (ddof 1) / sqrt(n); 0.0 for n < 2."""
    x = np.asarray(xs, dtype=np.float64)
    return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0


def finite_number(v: Any) -> bool:
    """Whether `v` is a finite int or float and not a bool: a figure that gets an EMA copy, a
    curve or a table cell."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
