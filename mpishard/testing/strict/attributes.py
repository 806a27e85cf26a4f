"""The parts of CuPy's ``ndarray`` that describe memory rather than compute on it:
``flags`` and the data pointer of ``__cuda_array_interface__``."""
from __future__ import annotations

import numpy as np

__all__ = ["Flags", "Pointer"]


class Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class Flags:
    """CuPy's ``flags``: ``c_contiguous``, ``f_contiguous``, ``owndata``."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, a: np.ndarray):
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous
        self.owndata = a.flags.owndata

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[key]
