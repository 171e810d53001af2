"""Small numpy helpers of the hot path, where host time per call is the cost that matters."""
from __future__ import annotations

import numpy as np

from transport.errors import InvalidTransfer

__all__ = ["as_array", "as_arrays", "distinct"]


def distinct(a: np.ndarray) -> list:
    """The sorted distinct values of the integer array ``a``, as a Python list. Why not ``np.unique`` alone: a
    batch's pieces nearly always share one value (one region, one device, one key), which a min and a max find for
    far less than ``np.unique``, which hashes or sorts every element."""
    if a.size == 0:
        return []
    lo, hi = int(a.min()), int(a.max())
    if lo == hi:
        return [lo]
    return np.unique(a).tolist()


def as_array(name: str, values) -> np.ndarray:
    """int64 array of a sequence of ints (list, tuple, numpy array, CPU tensor); anything else (floats,
    bools, strings, nested lists) raises InvalidTransfer naming the first bad entry."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # the common case of callers with many pieces: nothing to convert or check
    if hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # torch tensor
        values = values.tolist()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise InvalidTransfer(f"{name}: not a sequence of ints: {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidTransfer(f"{name} must be a flat sequence of ints, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        # numpy picked float / bool / object: name the first entry that is not an int
        for i, v in enumerate(values if isinstance(values, (list, tuple)) else arr.tolist()):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidTransfer(f"{name}[{i}] = {v!r} is not an int")
        raise InvalidTransfer(f"{name}: entries do not fit 64 bits")
    if arr.dtype.kind == "i" and isinstance(values, (list, tuple)) and int(arr.min()) <= 1:
        # numpy turns [4096, True] into ints: only a 0 or 1 can be a bool in disguise, so only then look
        for i, v in enumerate(values):
            if v.__class__ is bool:
                raise InvalidTransfer(f"{name}[{i}] = {v!r} is not an int")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
        i = int(np.argmax(arr))
        raise InvalidTransfer(f"{name}[{i}] = {int(arr[i])} does not fit a 64-bit address")
    return arr.astype(np.int64, copy=False)

def as_arrays(*named) -> tuple:
    """``as_array`` of each ``(name, values)`` pair; the arrays must have one length, else InvalidTransfer
    naming them and their lengths."""
    arrays = tuple([as_array(name, values) for name, values in named])
    n = arrays[0].size
    if any(a.size != n for a in arrays):
        names = [name for name, _ in named]
        raise InvalidTransfer(f"{', '.join(names[:-1])} and {names[-1]} must have the same length, got "
                              f"{', '.join(str(a.size) for a in arrays)}")
    return arrays
