"""Small numpy helpers of the hot path, where host time per call is the cost that matters."""
from __future__ import annotations

import struct

import numpy as np

from transport.errors import InvalidTransfer

__all__ = ["as_array", "as_arrays", "distinct", "extremes_and_total", "numpy_extremes_and_total", "pack_exact_ints"]

_FEW_FOR_BUILTINS = 24  # entries up to which numpy_extremes_and_total reads lists


def numpy_extremes_and_total(src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> tuple:
    """(min, max of ``src``, of ``dst``, of ``ln``, sum of ``ln``) of a batch's three int64 columns of one length
    n >= 1, by numpy: the two axis reductions of the three stacked, or builtins over lists for a few entries, where
    each numpy call's fixed cost is most of its time (about half at 11 entries on the 2-core machine)."""
    n = ln.size
    if n <= _FEW_FOR_BUILTINS:
        sl, dl, ll = src.tolist(), dst.tolist(), ln.tolist()
        return min(sl), max(sl), min(dl), max(dl), min(ll), max(ll), sum(ll)
    rows = np.empty((3, n), dtype=np.int64)
    rows[0], rows[1], rows[2] = src, dst, ln
    smin, dmin, lmin = rows.min(axis=1).tolist()
    smax, dmax, lmax = rows.max(axis=1).tolist()
    return smin, smax, dmin, dmax, lmin, lmax, lmin * n if lmin == lmax else int(ln.sum())


try:  # built by `pip install` where a C compiler is found (setup.py: optional); else struct and numpy do the work
    from transport._intpack import extremes_and_total
    from transport._intpack import pack_int64 as pack_exact_ints
except ImportError:
    pack_exact_ints = None  # not built: lists go through struct
    extremes_and_total = numpy_extremes_and_total


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


_PACKERS: dict = {}  # entries -> struct.Struct of that many int64s; a batch's shapes repeat, so few are made
_PACKERS_MAX = 512  # shapes kept; past that a packer is made per call (a few microseconds)
_I64 = 1 << 63
_INT64 = np.dtype(np.int64)  # numpy's one native int64 dtype: an identity test is the cheapest check of an array
_BOOL_SCAN = 64  # up to this many entries a list is searched for True / False; past it its array's minimum decides


def _packed(values) -> np.ndarray:
    """int64 array of a list or tuple of ints, in one C pass (``struct``): the floor of a list's conversion
    here. ``struct.error`` / ``TypeError`` on an entry that is not an int (floats, strings, numpy bools, nested
    lists) or does not fit int64; ``bool`` entries pass (they are ints): ``as_array`` looks for them."""
    n = len(values)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = struct.Struct(f"{n}q")
        if len(_PACKERS) < _PACKERS_MAX:
            _PACKERS[n] = packer
    arr = np.empty(n, dtype=np.int64)
    packer.pack_into(arr, 0, *values)
    return arr


def _first_bad(name: str, values) -> InvalidTransfer:
    """The error naming the first entry of ``values`` (a list or tuple that ``_packed`` refused) that is not an
    int (bools included) or does not fit 64 bits."""
    for i, v in enumerate(values):
        if v.__class__ is bool or not isinstance(v, (int, np.integer)):
            return InvalidTransfer(f"{name}[{i}] = {v!r} is not an int")
        v = int(v)
        if not -_I64 <= v < _I64:
            what = "a 64-bit address" if _I64 <= v < 2 * _I64 else "64 bits"
            return InvalidTransfer(f"{name}[{i}] = {v} does not fit {what}")
    return InvalidTransfer(f"{name}: not a sequence of ints")  # an int that ``struct`` took for none: unseen


def as_array(name: str, values) -> np.ndarray:
    """int64 array of a sequence of ints (list, tuple, numpy array, CPU tensor); anything else (floats,
    bools, strings, nested lists) raises InvalidTransfer naming the first bad entry.

    Lists and tuples of exact ints are packed by the C extension (``transport._intpack``, about 2 ns per entry on
    the 2-core machine under Python 3.11-3.13, 5-6 ns under others), others in one pass of ``struct`` (``_packed``,
    about 37 ns), where ``np.asarray`` first inferred a type in a pass of its own (benchmarks/NOTES.md); the
    entries ``_packed`` refuses, and the bools it lets pass, are then named. A CPU tensor is read through
    ``numpy()``, without a list in between."""
    if type(values) is np.ndarray and values.dtype is _INT64 and values.ndim == 1:
        return values  # the common case of callers with many pieces: nothing to convert or check
    cls = values.__class__
    if cls is list or cls is tuple:
        return _from_list(name, values)
    if hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # torch tensor
        try:
            return as_array(name, values.numpy())  # a CPU tensor's own memory: no list in between
        except (TypeError, RuntimeError, AttributeError):
            values = values.tolist()  # a GPU tensor or one that needs grad
    return _from_other(name, values)


def _from_list(name: str, values) -> np.ndarray:
    """``as_array`` of a list or tuple. Exact ints are packed by the C extension (a few ns per entry, no bool can
    pass it); a list it stops on (numpy integers, bools, anything else) is packed by ``struct``, then any bool
    among the entries named."""
    if not values:
        return np.zeros(0, dtype=np.int64)
    if pack_exact_ints is not None:
        arr = np.empty(len(values), dtype=np.int64)
        if pack_exact_ints(values, arr) < 0:
            return arr
    try:
        arr = _packed(values)
    except (struct.error, TypeError, OverflowError):
        raise _first_bad(name, values) from None
    # bools pass as ints: only a 0 or 1 can be one, and where the batch has none, no entry needs a look
    if (True in values or False in values) if len(values) <= _BOOL_SCAN else int(arr.min()) <= 1:
        _refuse_bools(name, values)
    return arr


def _refuse_bools(name: str, values) -> None:
    """InvalidTransfer naming the first bool among ``values`` (a list or tuple), if any."""
    for i, v in enumerate(values):
        if v.__class__ is bool:
            raise InvalidTransfer(f"{name}[{i}] = {v!r} is not an int")


def _from_other(name: str, values) -> np.ndarray:
    """``as_array`` of anything but a list, a tuple or a tensor (numpy arrays of other types or shapes, other
    sequences): through ``np.asarray``, whose inferred type tells an entry that is not an int."""
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
        _refuse_bools(name, values)
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
        i = int(np.argmax(arr))
        raise InvalidTransfer(f"{name}[{i}] = {int(arr[i])} does not fit a 64-bit address")
    return arr.astype(np.int64, copy=False)


def as_arrays(*named) -> tuple:
    """``as_array`` of each ``(name, values)`` pair; the arrays must have one length, else InvalidTransfer
    naming them and their lengths."""
    arrays = tuple([as_array(name, values) for name, values in named])
    n = arrays[0].size
    for a in arrays:
        if a.size == n:
            continue
        names = [name for name, _ in named]
        raise InvalidTransfer(f"{', '.join(names[:-1])} and {names[-1]} must have the same length, got "
                              f"{', '.join(str(a.size) for a in arrays)}")
    return arrays
