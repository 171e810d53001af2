"""Small numpy helpers of the hot path, where host time per call is the cost that matters."""
from __future__ import annotations

import numpy as np

__all__ = ["distinct"]


def distinct(a: np.ndarray) -> list:
    """The sorted distinct values of the integer array ``a``, as a Python list. Why not ``np.unique`` alone: a
    batch's pieces nearly always share one value (one region, one device, one key), which a min and a max find for
    far less than ``np.unique``, which hashes or sorts every element (benchmarks/NOTES.md, "Small batches without
    chunks")."""
    if a.size == 0:
        return []
    lo, hi = int(a.min()), int(a.max())
    if lo == hi:
        return [lo]
    return np.unique(a).tolist()
