"""Argument validation shared by gather, scatter and copy.

The checks are complete (every piece: lengths, address overflow, ranges inside the buffer, written ranges
disjoint) and on by default; they are built to cost little host time:

* GPU tensors of up to ``_device_checks.MAX_PIECES`` pieces are not read here: the summary kernel checks them
  on their GPU (one launch, one synchronisation); only a batch it finds a fault in comes here, to have the fault
  named, or one it leaves open (no piece of positive length, addresses on another GPU);
* the index arrays are read once: zero-copy when they are host arrays or CPU tensors, into a reused pinned
  buffer with one synchronisation when they are GPU tensors (one device-to-host copy for tensors that lie close
  together, else one per tensor);
* each check is one or two whole-array numpy reductions (an argument's min and max; its ends only when those
  do not settle it); only when one fails do the slower per-piece checks run, to name the first bad piece (the
  message holds its index and value); the address arguments' extremes are returned, and
  ``peer_access.reachable`` classifies an argument whose extremes lie in one known allocation by them alone;
* written ranges in ascending order (gathers into a chunk) are proven disjoint by one comparison of each end
  with the next start; only unordered ones (scatters into a paged pool) need more: a large batch of GPU
  tensors is sorted there (``torch.sort``, one synchronisation); on the host, rows of one power-of-two length
  on their grid are told apart by a bitmap of slots, anything else is sorted with numpy (on 32-bit keys when
  the span allows).
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from pxn_kernels import _staging

_INT64_MAX = (1 << 63) - 1
# Unordered written ranges on a GPU from this many pieces are sorted there (torch.sort, one synchronisation)
# instead of on the host.
DEVICE_SORT_MIN = 4096


def check_byte_tensor(op: str, name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{op}: {name} must be uint8, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (shape {tuple(tensor.shape)}, "
                         f"strides {tensor.stride()})")


def check_index_tensors(op: str, device: torch.device, **tensors) -> int:
    """All int64, 1-D, on ``device``, same length. Returns that length."""
    count = None
    first_name = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{op}: {name} must be an int64 torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.int64:
            raise ValueError(f"{op}: {name} must be int64, got {tensor.dtype}")
        if tensor.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(tensor.shape)}")
        if tensor.device != device:
            raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device}")
        if count is None:
            count, first_name = tensor.numel(), name
        elif tensor.numel() != count:
            raise ValueError(f"{op}: {name} has {tensor.numel()} items but {first_name} has {count}")
    return count


def to_host(*tensors):
    """Host numpy arrays of several int64 tensors (one device, one length): views of CPU tensors (no copy); for
    CUDA tensors, a copy into the calling thread's pinned read buffer on the current stream and one
    synchronisation (``_staging.read_to_host``: the arrays are valid until the thread's next read), or one
    stacked copy where that cannot be used."""
    if not tensors or tensors[0].numel() == 0:
        return [np.zeros(0, dtype=np.int64) for _ in tensors]
    first = tensors[0]
    if not first.is_cuda:
        return [t.numpy() for t in tensors]
    index = first.get_device()
    if _staging.on_device(index):
        got = _staging.read_to_host(tensors, index)
    else:
        with torch.cuda.device(index):
            got = _staging.read_to_host(tensors, index)
    if got is not None:
        return got
    stacked = torch.stack(tensors).cpu().numpy()
    return list(stacked)


class LengthStats(NamedTuple):
    """min, max and sum of a batch's lengths (bytes); what the plan needs from them. ``spans``: for each address
    argument the checks looked at (by name), the lowest and highest start address of its pieces of positive
    length (what ``peer_access.reachable`` classifies by); None or a missing name: not known."""

    lmin: int
    lmax: int
    total: int
    spans: Optional[dict] = None


def check_lengths(op: str, lengths: np.ndarray) -> None:
    negative = np.nonzero(lengths < 0)[0]
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"{op}: lengths[{i}] = {int(lengths[i])} is negative")


def check_addresses(op: str, name: str, addrs: np.ndarray, lengths: np.ndarray) -> None:
    """Raw addresses of non-empty items must be positive and not overflow."""
    live = lengths > 0
    bad = np.nonzero(live & (addrs <= 0))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = {int(addrs[i])} is not a valid address (lengths[{i}] = "
                         f"{int(lengths[i])})")
    bad = np.nonzero(live & (addrs > _INT64_MAX - lengths))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = 0x{int(addrs[i]):x} + {int(lengths[i])} overflows")


def check_ranges_in(op: str, name: str, offsets: np.ndarray, lengths: np.ndarray, limit: int,
                    limit_name: str) -> None:
    """Offsets of non-empty items must satisfy ``0 <= offset`` and ``offset + length <= limit``."""
    live = lengths > 0
    bad = np.nonzero(live & (offsets < 0))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = {int(offsets[i])} is negative")
    bad = np.nonzero(live & (offsets > limit - lengths))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = {int(offsets[i])} + lengths[{i}] = {int(lengths[i])} runs past "
                         f"{limit_name} ({limit} bytes)")


def check_no_overlap(op: str, name: str, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Written ranges must not overlap (the result would depend on the order programs run in)."""
    live = np.nonzero(lengths > 0)[0]
    if live.size < 2:
        return
    order = live[np.argsort(starts[live], kind="stable")]
    ends = starts[order] + lengths[order]
    clash = np.nonzero(ends[:-1] > starts[order][1:])[0]
    if clash.size:
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        raise ValueError(f"{op}: {name}[{a}] = {int(starts[a])} (length {int(lengths[a])}) overlaps "
                         f"{name}[{b}] = {int(starts[b])} (length {int(lengths[b])})")


def _disjoint_sorted(starts: np.ndarray, ends: Optional[np.ndarray], equal: int, lowest: Optional[int] = None,
                     highest: Optional[int] = None) -> bool:
    """Whether ranges [starts[i], ends[i]) of positive length are pairwise disjoint, in any order.

    Sorting starts and ends separately suffices: the i-th smallest end is at most the (i+1)-th smallest start
    for every i exactly when no two ranges overlap. ``equal`` > 0: every range has this length, so the sorted
    starts alone decide (neighbours at least ``equal`` apart) and ``ends`` may be None. ``lowest`` /
    ``highest``: the smallest and largest start when the caller has them (saves passes over the array).
    """
    base = int(starts.min()) if lowest is None else lowest
    if equal:
        top = (int(starts.max()) if highest is None else highest) + equal
    else:
        if ends is None:
            raise ValueError("_disjoint_sorted: ranges of several lengths need their ends")
        top = int(ends.max())
    if top - base < (1 << 32):  # 32-bit keys sort about twice as fast
        starts = (starts - base).astype(np.uint32)
        ends = None if equal else (ends - base).astype(np.uint32)
    s = np.sort(starts)
    if equal:
        return bool((np.diff(s) >= equal).all())
    e = np.sort(ends)
    return bool((e[:-1] <= s[1:]).all())


def _distinct_slots(starts: np.ndarray, lowest: int, highest: int, length: int) -> Optional[bool]:
    """Whether ranges of one power-of-two ``length`` (bytes) are pairwise disjoint, for starts that all lie on
    that grid counted from the lowest (the rows of a paged pool): exactly when no two share a slot, which a
    bitmap of the span tells in a few passes, cheaper than a sort.
    None: not such a batch (another length, a start off the grid, a span of more than 16 slots per range);
    the caller sorts."""
    n = starts.size
    if length & (length - 1) or (highest - lowest) // length >= 16 * n:
        return None
    rel = starts - lowest
    if int(np.bitwise_or.reduce(rel)) & (length - 1):
        return None
    seen = np.zeros((highest - lowest) // length + 1, dtype=np.bool_)
    seen[rel >> (length.bit_length() - 1)] = True
    return int(np.count_nonzero(seen)) == n


def _disjoint_on_device(starts: torch.Tensor, lengths: torch.Tensor, equal: int) -> bool:
    """As ``_disjoint_sorted`` on the GPU: torch.sort, one flag, one synchronisation."""
    s = torch.sort(starts).values
    if equal:
        bad = (s[1:] - s[:-1] < equal).any()
    else:
        e = torch.sort(starts + lengths).values
        bad = (e[:-1] > s[1:]).any()
    return not bool(bad)


def _fast_ok(lengths: np.ndarray, lmin: int, lmax: int, checks, written, written_device) -> Optional[dict]:
    """Every check on pieces of positive length (``lengths`` >= 1 here), as whole-array reductions (a numpy call has a
    fixed cost comparable to its pass over tens of thousands of items, so their number is what counts). Returns the
    address arguments' (lowest, highest) starts by name (``LengthStats.spans``), or None when some check failed (the
    caller runs the per-piece checks to name it).

    The written ranges are looked at first: when each ends before the next starts and no end wrapped past
    2**63 (the smallest end is positive), their starts strictly increase, so the first and last entries are the
    smallest and largest and their checks need no further pass. A batch whose first 8 starts do not increase
    is not in that order, and skips the test. Elsewhere a start + length is only formed when the extremes
    cannot rule a failure out (the largest start plus the longest length past the bound)."""
    spans = {}
    ends = {}
    extremes = {}
    ordered = False
    n = lengths.size
    if written is not None and n >= 2:
        name, starts = written
        head = starts[:8].tolist()
        if all(map(operator.lt, head, head[1:])):
            end = starts + lengths  # a sum past 2**63 wraps negative: both terms positive, or the check fails anyway
            ends[name] = end
            ordered = bool((end[:-1] <= starts[1:]).all()) and int(end.min()) >= 1
    for check in checks:
        kind, name, values = check[0], check[1], check[2]
        in_order = ordered and name == written[0]
        if in_order:
            lo, hi = int(values[0]), int(values[-1])
        else:
            lo, hi = int(values.min()), int(values.max())
        extremes[name] = (lo, hi)
        if kind == "address":
            if not _address_fits(name, values, lengths, lo, hi, lmax, ends):
                return None
            spans[name] = (lo, hi)
        elif not _bounded_fits(name, values, lengths, lo, hi, lmax, check[3], in_order, ends):
            return None
    if written is None or n < 2 or ordered:
        return spans
    return spans if _written_disjoint(written, lengths, lmin, lmax, extremes, ends, written_device) else None


def _address_fits(name, values, lengths, lo: int, hi: int, lmax: int, ends: dict) -> bool:
    """``_fast_ok``'s address check of ``values`` (extremes ``lo``, ``hi``): positive, and no start + length past
    2**63, formed (and kept in ``ends``) only when the extremes cannot rule that out."""
    if lo < 1:
        return False
    if hi > _INT64_MAX - lmax:  # some start + length may pass 2**63: the exact test
        end = ends.get(name)
        if end is None:
            end = ends[name] = values + lengths
        if int(end.min()) < 1:
            return False
    return True


def _bounded_fits(name, values, lengths, lo: int, hi: int, lmax: int, limit: int, in_order: bool, ends: dict) -> bool:
    """``_fast_ok``'s check of offsets ``values`` (extremes ``lo``, ``hi``) into a buffer of ``limit`` bytes, the
    largest end formed (and kept in ``ends``) only when the extremes do not settle it."""
    if lmax > limit or lo < 0 or hi > limit:
        return False
    if hi + lmax > limit:  # the extremes do not settle it: the largest end (no overflow: each <= limit)
        end = ends.get(name)
        if end is None:
            end = ends[name] = values + lengths
        if int(end[-1] if in_order else end.max()) > limit:
            return False
    return True


def _written_disjoint(written, lengths, lmin: int, lmax: int, extremes: dict, ends: dict, written_device) -> bool:
    """Whether the written ranges, not in ascending order, are disjoint: rows of one length by a bitmap of
    slots, else on the device when the caller has them there, else sorted on the host."""
    name, starts = written
    equal = lmin if lmin == lmax else 0
    if equal:
        # rows of a paged pool: the bitmap on the host copy the checks already hold, before a sort on the GPU
        # (a sort, a flag and a synchronisation cost more host time than the bitmap's few passes)
        lo, hi = extremes.get(name) or (int(starts.min()), int(starts.max()))
        ok = _distinct_slots(starts, lo, hi, equal)
        if ok is not None:
            return ok
    if written_device is not None:
        return _disjoint_on_device(*written_device, equal)
    if equal:
        return _disjoint_sorted(starts, None, equal, lo, hi)
    end = ends.get(name)
    if end is None:
        end = starts + lengths
    return _disjoint_sorted(starts, end, 0, (extremes.get(name) or (None,))[0])


# Up to this many pieces the checks run on Python lists: a numpy call's fixed cost exceeds the work below it.
SMALL = 64


def _small_ok(lengths: list, lmin: int, lmax: int, checks, written) -> Optional[dict]:
    """``_fast_ok`` on Python ints (exact: no overflow to guard against) for small batches (``lmin`` / ``lmax``:
    the lengths' extremes). The written ranges first: in ascending order (each end at most the next start) or,
    failing that, sorted, which gives their argument's extremes without a pass of its own; then each argument's
    extremes, its ends only where those do not settle a check."""
    spans = {}
    if lmin > 0:
        pick = None
    else:
        live = [i for i, n in enumerate(lengths) if n > 0]
        if not live:
            return spans
        lengths = [lengths[i] for i in live]
        lmin = min(lengths)
        pick = lambda values: [values[i] for i in live]  # noqa: E731
    known = None
    if written is not None and len(lengths) >= 2:
        known = _small_written(written, lengths, lmin, lmax, pick)
        if known is None:
            return None
    for check in checks:
        if known is not None and check[1] == known[0]:
            _, values, lo, hi = known
        else:
            values = check[2].tolist()
            if pick is not None:
                values = pick(values)
            lo, hi = min(values), max(values)
        if check[0] == "address":
            if lo < 1 or (hi + lmax > _INT64_MAX and max(map(operator.add, values, lengths)) > _INT64_MAX):
                return None
            spans[check[1]] = (lo, hi)
        elif lo < 0 or (hi + lmax > check[3] and max(map(operator.add, values, lengths)) > check[3]):
            return None
    return spans


def _small_written(written, lengths: list, lmin: int, lmax: int, pick):
    """``_small_ok``'s overlap check of the written ranges: (their argument's name, starts, lowest, highest), or
    None when two overlap. One length: neighbours at least that far apart; else each end at most the next start.
    Unordered: the i-th smallest end must not pass the (i+1)-th smallest start (see _disjoint_sorted); with one
    length the ends of the sorted starts are in order already."""
    starts = written[1].tolist()
    if pick is not None:
        starts = pick(starts)
    if lmin == lmax:
        # a batch whose two first or two last starts are not in order skips the pass that would find it out
        if starts[1] - starts[0] >= lmin and starts[-1] - starts[-2] >= lmin \
                and min(map(operator.sub, starts[1:], starts)) >= lmin:
            return written[0], starts, starts[0], starts[-1]
        ordered = sorted(starts)
        if min(map(operator.sub, ordered[1:], ordered)) < lmin:
            return None
        return written[0], starts, ordered[0], ordered[-1]
    if all(map(operator.le, map(operator.add, starts, lengths), starts[1:])):
        return written[0], starts, starts[0], starts[-1]
    ordered = sorted(starts)
    if not all(map(operator.le, sorted(map(operator.add, starts, lengths)), ordered[1:])):
        return None
    return written[0], starts, ordered[0], ordered[-1]


def address(name: str, addrs: np.ndarray):
    """A ``validate`` check: raw addresses, positive, address + length without overflow."""
    return ("address", name, addrs)


def within(name: str, offsets: np.ndarray, limit: int, limit_name: str):
    """A ``validate`` check: offsets with ``0 <= offset`` and ``offset + length <= limit`` (bytes)."""
    return ("range", name, offsets, limit, limit_name)


def validate(op: str, lengths: np.ndarray, checks: Sequence[tuple] = (),
             written: Optional[Tuple[str, np.ndarray]] = None,
             written_tensors: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> LengthStats:
    """Check a batch completely; raise ``ValueError`` naming the first bad piece, its argument and value.

    Arguments (host int64 arrays, one entry per piece):
        lengths: bytes per piece (>= 0).
        checks: ``address(...)`` and ``within(...)`` entries, in the order their errors take precedence.
        written: (name, starts): the destination ranges, which must not overlap.
        written_tensors: (starts, lengths) as GPU tensors: a large unordered batch is then sorted there.
    Pieces of length 0 are exempt from every check but the sign of their length.
    Returns:
        the lengths' min, max and sum, and the address arguments' lowest and highest starts.
    """
    n = lengths.size
    if n == 0:
        return LengthStats(0, 0, 0, {})
    if n <= SMALL:
        as_list = lengths.tolist()
        first = as_list[0]
        if as_list.count(first) == n:  # one length (rows): its extremes and sum without a pass each
            lmin = lmax = first
            total = first * n
        else:
            lmin, lmax, total = min(as_list), max(as_list), sum(as_list)
        if lmin < 0:
            check_lengths(op, lengths)
        spans = _small_ok(as_list, lmin, lmax, checks, written)
        if spans is None:
            _name_failure(op, lengths, checks, written)
        return LengthStats(lmin, lmax, total, spans)
    lmin, lmax = int(lengths.min()), int(lengths.max())
    if lmin < 0:
        check_lengths(op, lengths)
    device = written_tensors if written_tensors is not None and n >= DEVICE_SORT_MIN and \
        written_tensors[0].is_cuda else None
    if lmin > 0:
        spans = _fast_ok(lengths, lmin, lmax, checks, written, device)
    else:  # pieces of length 0 are exempt: check the others
        live = np.flatnonzero(lengths)
        spans = {} if not live.size else _fast_ok(
            lengths[live], int(lengths[live].min()), lmax, [c[:2] + (c[2][live],) + c[3:] for c in checks],
            None if written is None else (written[0], written[1][live]), None)
    if spans is None:
        _name_failure(op, lengths, checks, written)
    return LengthStats(lmin, lmax, lmin * n if lmin == lmax else int(lengths.sum()), spans)


def _name_failure(op: str, lengths: np.ndarray, checks, written) -> None:
    """Raise for the first bad piece (the per-piece checks, in the order the caller gave)."""
    for check in checks:
        if check[0] == "address":
            check_addresses(op, check[1], check[2], lengths)
        else:
            check_ranges_in(op, check[1], check[2], lengths, check[3], check[4])
    if written is not None:
        check_no_overlap(op, written[0], written[1], lengths)


class IndexArgs:
    """The index arguments of one call: ``count`` pieces, given either as tensors on the copy's device
    (``on_host`` False) or as host arrays (numpy int64 or CPU tensors, ``on_host`` True, only for a GPU copy)."""

    __slots__ = ("count", "on_host", "values", "_host")

    def __init__(self, count: int, on_host: bool, values: dict, _host: Optional[list] = None):
        self.count = count
        self.on_host = on_host
        self.values = values  # name -> torch.Tensor (device mode) or np.ndarray (host mode)
        self._host = _host

    def host(self) -> list:
        """Host int64 arrays of every argument, in the order given (read once, see ``to_host``)."""
        if self._host is None:
            values = list(self.values.values())
            self._host = values if self.on_host else to_host(*values)
        return self._host


_INT64 = np.dtype(np.int64)


def _host_arrays(op: str, named: dict):
    """(count, name -> contiguous int64 numpy array) of host arguments (numpy arrays or CPU tensors), each
    int64, 1-D and of one length; else ValueError naming the argument and what it is."""
    count, first_name, values = None, None, {}
    for name, value in named.items():
        array = value.numpy() if isinstance(value, torch.Tensor) else value
        dtype = array.dtype
        if dtype is not _INT64 and dtype != _INT64:
            raise ValueError(f"{op}: {name} must be int64, got {dtype}")
        if array.ndim != 1:
            raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(array.shape)}")
        if count is None:
            count, first_name = array.size, name
        elif array.size != count:
            raise ValueError(f"{op}: {name} has {array.size} items but {first_name} has {count}")
        values[name] = np.ascontiguousarray(array)
    return count, values


def _plain_arrays(named: dict) -> int:
    """The count of index arguments that are all contiguous 1-D int64 numpy arrays of one length (what a caller
    holding its descriptors on the host passes), else -1: the general path looks at them one by one."""
    count = -1
    for array in named.values():
        if type(array) is not np.ndarray or array.dtype is not _INT64 or array.ndim != 1 \
                or not array.flags.c_contiguous or (count >= 0 and array.size != count):
            return -1
        count = array.size
    return count


def _plain_tensors(named: dict, device: torch.device) -> int:
    """As ``_plain_arrays`` for contiguous 1-D int64 tensors on ``device`` (a caller holding its descriptors
    there), else -1."""
    count = -1
    for tensor in named.values():
        if type(tensor) is not torch.Tensor or tensor.dtype is not torch.int64 or tensor.dim() != 1 \
                or not tensor.is_contiguous() or tensor.device != device \
                or (count >= 0 and tensor.numel() != count):
            return -1
        count = tensor.numel()
    return count


def index_args(op: str, device: torch.device, **named) -> IndexArgs:
    """Validate the index arguments' types: int64, 1-D, one length. Either all tensors on ``device``, or all on
    the host (numpy arrays or CPU tensors): for a GPU ``device`` those are checked where they are and uploaded
    once (``_batched_copy.run_batch``); for the CPU they are viewed as tensors (no copy)."""
    count = _plain_arrays(named)
    if count >= 0:
        if device.type != "cpu":
            return IndexArgs(count, True, named)
        # the CPU copy launches from tensors; the checks read the arrays themselves (no round trip through torch)
        return IndexArgs(count, False, {k: torch.from_numpy(a) for k, a in named.items()}, list(named.values()))
    count = _plain_tensors(named, device)
    if count >= 0:
        return IndexArgs(count, False, named)
    if device.type != "cpu":
        for v in named.values():
            if not isinstance(v, np.ndarray) and not (isinstance(v, torch.Tensor) and v.device.type == "cpu"):
                return IndexArgs(check_index_tensors(op, device, **named), False, _flat(named))
        count, arrays = _host_arrays(op, named)
        return IndexArgs(count, True, arrays)
    host_kinds = all(isinstance(v, np.ndarray) or (isinstance(v, torch.Tensor) and v.device.type == "cpu")
                     for v in named.values())
    values = named
    if any(isinstance(v, np.ndarray) for v in named.values()):
        if host_kinds:
            count, arrays = _host_arrays(op, named)
            return IndexArgs(count, False, {k: torch.from_numpy(a) for k, a in arrays.items()},
                             list(arrays.values()))
        values = {k: torch.from_numpy(np.ascontiguousarray(v))
                  if isinstance(v, np.ndarray) and v.dtype == np.int64 and v.ndim == 1 else v
                  for k, v in named.items()}
    return IndexArgs(check_index_tensors(op, device, **values), False, _flat(values))


def _flat(tensors: dict) -> dict:
    """The checked index tensors as the kernels read them: flat arrays from their data pointer. A strided view
    (e.g. every other element of a larger tensor) is copied into a contiguous one; others pass as they are."""
    if all(t.is_contiguous() for t in tensors.values()):
        return tensors
    return {k: t if t.is_contiguous() else t.contiguous() for k, t in tensors.items()}
