"""Small numpy helpers of the hot path, where host time per call is the cost that matters."""
from __future__ import annotations

import numpy as np

__all__ = ["distinct"]


def distinct(a: np.ndarray) -> list:
    """The sorted distinct values of the integer array ``a``, as a Python list. Why not ``np.unique`` alone: a
    batch's pieces nearly always share one value (one region, one device, one key), which a min and a max find in
    a few us, where ``np.unique`` hashes or sorts every element (~100 us for 4096 on the H200 VM)."""
    if a.size == 0:
        return []
    lo, hi = int(a.min()), int(a.max())
    if lo == hi:
        return [lo]
    return np.unique(a).tolist()
