"""The predicates and the raise helper every config check uses, and the allowed model dtypes and
GELUs, so a check reads the same (and accepts the same numbers) wherever it runs.

numpy only (no jax): the data transforms check their fields inside the pipeline's worker
processes. A check raises one line naming the field, the bad value and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")  # config.model.dtype
GELUS = ("tanh", "exact")  # config.model.gelu: tanh approximation or the erf form


def require(ok: bool, message: str) -> None:
    """Raises ValueError(message) unless `ok`."""
    if not ok:
        raise ValueError(message)


def is_number(value: Any) -> bool:
    """A Python or numpy int or float (not a bool); it may be inf or nan."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_finite(value: Any) -> bool:
    """A number that is neither inf nor nan."""
    return is_number(value) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_positive_int(value: Any) -> bool:
    """An integer >= 1."""
    return is_int(value) and value >= 1
