"""mpishard.core.dtypes: which dtypes are 16-bit floats (every op asks, on its hot path)."""
from __future__ import annotations

import numpy as np
import pytest

from mpishard.core import dtypes
from mpishard.core.dtypes import is_low_precision, resolve_dtype


@pytest.mark.parametrize("first", ["float16", "bfloat16"])
def test_is_low_precision_by_dtype_and_by_name_whatever_was_seen_first(monkeypatch, first):
    """float16 and bfloat16 are 16-bit floats, as dtypes (remembered once seen: a set
    lookup after that) or names; 16-bit integers and wider floats are not,
    before and after."""
    monkeypatch.setattr(dtypes, "_LOW_DTYPES", frozenset())
    low = [resolve_dtype(first), resolve_dtype("bfloat16" if first == "float16" else "float16")]
    other = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int16),
             np.dtype(np.uint16), np.dtype(np.int8)]
    for _ in range(2):
        assert all(is_low_precision(d) for d in low)
        assert not any(is_low_precision(d) for d in other)
    assert dtypes._LOW_DTYPES == frozenset(low)
    assert is_low_precision("bfloat16") and is_low_precision("float16")
    assert not is_low_precision("float32") and not is_low_precision("uint16")
