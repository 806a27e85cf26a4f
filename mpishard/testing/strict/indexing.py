"""How the strict array classifies an index (after unwrapping): whether it gathers
(an array or a list in it: a kernel launch, not a view) and whether its output shape
depends on the data (a boolean mask: a host sync, the size is read back)."""
from __future__ import annotations

import numpy as np

__all__ = ["data_dependent", "advanced"]


def data_dependent(index) -> bool:
    """Whether indexing with ``index`` has an output shape that depends on the data."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, np.ndarray) and i.dtype == np.bool_ and i.ndim > 0 for i in items)


def advanced(index) -> bool:
    """Whether ``index`` gathers or scatters (an array or a list in it), not a view."""
    if isinstance(index, tuple):
        return any(isinstance(i, (np.ndarray, list)) for i in index)
    return isinstance(index, (np.ndarray, list))
