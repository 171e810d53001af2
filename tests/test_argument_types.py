"""A batch's arguments as lists, tuples, int64 arrays or CPU tensors: converted alike (``transport.arrays``), every
bad entry refused by name whatever the container, and the same route taken whatever the type (``stats()["routes"]``),
through the native API and the Mooncake API.

End-to-end cases write fresh random bytes into a poisoned peer (another process) and compare its whole buffer,
guards included, with the expected image.
"""
import enum
import re

import numpy as np
import pytest
import torch

from engine_helpers import EnginePeer, Expected, disjoint_offsets
from transport import InvalidTransfer, TransferEngine
import transport.arrays as arrays_module
from transport.arrays import as_array

AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
MB = 1 << 20
KINDS = ("list", "tuple", "array", "tensor")


def _as(kind: str, values: list):
    if kind == "list":
        return list(values)
    if kind == "tuple":
        return tuple(values)
    arr = np.asarray(values, dtype=np.int64)
    return arr if kind == "array" else torch.from_numpy(arr)


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


@pytest.fixture(params=["c", "struct"])
def packer(request, monkeypatch):
    """Each conversion case twice: lists packed by the C extension (``transport._intpack``, built at install where
    a compiler is found) and by ``struct``, the fallback without it."""
    if request.param == "c" and arrays_module.pack_exact_ints is None:
        pytest.skip("transport._intpack is not built here (pip install -e . builds it where a C compiler is found)")
    if request.param == "struct":
        monkeypatch.setattr(arrays_module, "pack_exact_ints", None)
    return request.param


# --- conversion -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 11, 63, 64, 65, 4097])
@pytest.mark.parametrize("kind", KINDS)
def test_as_array_gives_the_entries_as_int64(kind, n, rng, packer):
    values = rng.integers(0, 1 << 62, n, dtype=np.int64).tolist()
    values[rng.integers(n)] = 0
    values[rng.integers(n)] = (1 << 63) - 1
    arr = as_array("srcs", _as(kind, values))
    assert arr.dtype == np.int64 and arr.ndim == 1
    assert arr.tolist() == values


class _Unit(enum.IntEnum):
    PAGE = 4096


def test_as_array_takes_numpy_ints_in_a_list_and_empty_sequences(packer):
    assert as_array("x", [np.int64(7), 9, np.int32(-3)]).tolist() == [7, 9, -3]
    assert as_array("x", [5, _Unit.PAGE, -(1 << 63)]).tolist() == [5, 4096, -(1 << 63)]  # int subclasses are ints
    for empty in ([], (), np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.int64)):
        got = as_array("x", empty)
        assert got.dtype == np.int64 and got.size == 0


# (entry, text of its repr in the message); each put at a random place of a list of good ints
BAD_ENTRIES = [(2.5, "2.5 is not an int"), (64.0, "64.0 is not an int"), (True, "True is not an int"),
               (False, "False is not an int"), ("7", "'7' is not an int"), (None, "None is not an int"),
               ([1], r"\[1\] is not an int"), (np.float64(3.0), r"np.float64\(3.0\) is not an int"),
               (np.bool_(True), "np.True_ is not an int"), (1 << 64, f"{1 << 64} does not fit 64 bits"),
               (-(1 << 63) - 1, f"{-(1 << 63) - 1} does not fit 64 bits"),
               (1 << 63, f"{1 << 63} does not fit a 64-bit address"),
               (np.uint64(1 << 63), f"{1 << 63} does not fit a 64-bit address")]


@pytest.mark.parametrize("n", [3, 11, 100])
@pytest.mark.parametrize("container", ["list", "tuple"])
@pytest.mark.parametrize("bad,text", BAD_ENTRIES)
def test_a_bad_entry_of_a_list_is_named(bad, text, container, n, rng, packer):
    values = rng.integers(2, 1 << 40, n).tolist()
    i = int(rng.integers(n))
    values[i] = bad
    with pytest.raises(InvalidTransfer) as ei:
        as_array("dsts", list(values) if container == "list" else tuple(values))
    assert re.fullmatch(rf"dsts\[{i}\] = {text}", str(ei.value)), str(ei.value)


def test_the_c_packer_stops_at_the_first_entry_it_does_not_take_and_checks_its_buffer(rng):
    pack = arrays_module.pack_exact_ints
    if pack is None:
        pytest.skip("transport._intpack is not built here (pip install -e . builds it where a C compiler is found)")
    values = rng.integers(-(1 << 62), 1 << 62, 257).tolist() + [(1 << 63) - 1, -(1 << 63)]
    out = np.full(len(values), -7, dtype=np.int64)  # poisoned: every entry must be written
    assert pack(values, out) == -1 and out.tolist() == values
    assert pack(tuple(values), out) == -1 and out.tolist() == values
    for bad in (True, np.int64(3), 2.0, "7", _Unit.PAGE, 1 << 63, -(1 << 63) - 1):
        i = int(rng.integers(len(values)))
        assert pack(values[:i] + [bad] + values[i + 1:], out) == i, bad
    with pytest.raises(ValueError, match=r"out holds 8 bytes, 2 entries need 16"):
        pack([1, 2], np.zeros(1, dtype=np.int64))
    with pytest.raises(TypeError, match=r"values must be a list or tuple, got numpy.ndarray"):
        pack(np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64))
    with pytest.raises(BufferError, match=r"not writable|read-only"):
        pack([1], b"\0" * 8)


def test_the_c_packer_reads_ints_of_every_width_exactly(rng):
    """Ints of up to two 30-bit digits are read from their digits where CPython's layout is known
    (``READS_DIGITS``), wider ones through the C API: every width from 0 to 63 bits, both signs, and the values
    where the digit count changes, each at a random place of a poisoned buffer."""
    pack = arrays_module.pack_exact_ints
    if pack is None:
        pytest.skip("transport._intpack is not built here (pip install -e . builds it where a C compiler is found)")
    edges = [0, 1, -1, 2, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, (1 << 60) - 1, 1 << 60, (1 << 60) + 1,
             (1 << 63) - 1, 0x7F3A_1000_0040]
    edges += [-v for v in edges] + [-(1 << 63)]
    widths = [int(rng.integers(1 << (w - 1), 1 << w, dtype=np.uint64)) for w in range(1, 64)]
    values = edges + widths + [-v for v in widths]
    values = [values[i] for i in rng.permutation(len(values))]
    out = np.full(len(values), 0x5A5A5A5A5A5A5A5A, dtype=np.int64)
    assert pack(values, out) == -1
    assert out.tolist() == values, [(i, v, w) for i, (v, w) in enumerate(zip(values, out.tolist())) if v != w][:5]
    for bad in (1 << 63, (1 << 64) - 1, -(1 << 63) - 1, 1 << 90, -(1 << 90)):
        i = int(rng.integers(len(values)))
        assert pack(values[:i] + [bad] + values[i + 1:], out) == i, bad


@pytest.mark.parametrize("n", [1, 2, 3, 11, 24, 25, 4097])
@pytest.mark.parametrize("way", ["c", "numpy"])
def test_a_batchs_extremes_and_total_are_exact(n, way, rng):
    if way == "c" and arrays_module.extremes_and_total is arrays_module.numpy_extremes_and_total:
        pytest.skip("transport._intpack is not built here (pip install -e . builds it where a C compiler is found)")
    f = arrays_module.extremes_and_total if way == "c" else arrays_module.numpy_extremes_and_total
    lo, hi = -(1 << 63), (1 << 63) - 1
    cols = [rng.integers(lo, hi, n, dtype=np.int64, endpoint=True) for _ in range(3)]
    cols[2] = rng.integers(0, 1 << 40, n, dtype=np.int64)  # lengths: their sum must not wrap to compare with numpy
    for col in cols[:2]:  # the int64 bounds themselves, at random places
        col[rng.integers(n)] = lo
        col[rng.integers(n)] = hi
    want = []
    for col in cols:
        want += [int(col.min()), int(col.max())]
    assert f(*cols) == (*want, int(cols[2].sum()))


def test_a_strided_view_is_read_by_numpy(rng):
    base = rng.integers(0, 1 << 40, 64, dtype=np.int64)
    view = base[::2]
    f = arrays_module.extremes_and_total
    if f is not arrays_module.numpy_extremes_and_total:
        with pytest.raises(ValueError, match="C-contiguous"):
            f(view, view, view)
    assert arrays_module.numpy_extremes_and_total(view, view, view)[:2] == (int(view.min()), int(view.max()))


def test_strided_int64_arrays_are_written_byte_exact(peer, src, rng):
    lengths = [100] * 65  # past the rows route: the batch is validated on its arrays
    srcs, dsts, exp = _batch(rng, src, peer, lengths)
    cols = []
    for values in (srcs, dsts, lengths):
        wide = np.full(2 * len(values), -1, dtype=np.int64)  # every other entry poison: a view must skip them
        wide[::2] = values
        cols.append(wide[::2])
    with TransferEngine(fabric="tcp") as eng:
        eng.register(src)
        peer.poison()
        eng.batch_write(peer.session, *cols)
    peer.check(exp)


@pytest.mark.parametrize("kind", ["array", "tensor"])
def test_a_bad_entry_of_an_array_or_tensor_is_named(kind):
    # an array of floats or bools: its first entry is not an int
    for arr, text in ((np.asarray([5, 7, 2.5]), r"\[0\] = 5.0 is not an int"),
                      (np.asarray([True, False]), r"\[0\] = True is not an int")):
        with pytest.raises(InvalidTransfer, match=r"lengths" + text):
            as_array("lengths", arr if kind == "array" else torch.from_numpy(arr))
    big = np.asarray([5, 1 << 63], dtype=np.uint64)
    with pytest.raises(InvalidTransfer, match=rf"lengths\[1\] = {1 << 63} does not fit"):
        as_array("lengths", big)
    with pytest.raises(InvalidTransfer, match=r"flat sequence of ints, got shape \(2, 2\)"):
        as_array("lengths", np.ones((2, 2), dtype=np.int64) if kind == "array" else torch.ones(2, 2,
                                                                                             dtype=torch.int64))


# --- one route per batch ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peer():
    p = EnginePeer(8 * MB, fabric="tcp")
    yield p
    p.close()


@pytest.fixture(scope="module")
def src():
    from suite_env import SEED
    rng = np.random.default_rng([SEED, 51])
    return np.frombuffer(rng.bytes(8 * MB), dtype=np.uint8).copy()


def _batch(rng, src, peer, lengths):
    """Fresh random source bytes, random disjoint places; (srcs, dsts, expected image)."""
    src[:] = np.frombuffer(rng.bytes(src.size), dtype=np.uint8)
    s_offs, d_offs = disjoint_offsets(rng, lengths, 4 * MB), disjoint_offsets(rng, lengths, 4 * MB)
    exp = Expected(peer.size)
    exp.apply(src, s_offs, d_offs, lengths)
    return ([src.ctypes.data + int(o) for o in s_offs], [peer.base + int(o) for o in d_offs], exp)


def _routes(eng) -> dict:
    return dict(eng.stats()["routes"])


def _route_of(eng, call) -> dict:
    """The routes ``call()`` took, by ``stats()["routes"]`` before and after."""
    before = _routes(eng)
    call()
    after = _routes(eng)
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.mark.parametrize("lengths", [AUX, [100] * 65, [4096] * 200 + [65536] * 3], ids=["aux11", "65x100B", "mix203"])
def test_the_route_does_not_depend_on_the_argument_type(peer, src, rng, lengths):
    taken = {}
    with TransferEngine(fabric="tcp") as eng:
        eng.register(src)
        eng.batch_write(peer.session, [src.ctypes.data], [peer.base], [1])  # the first batch handshakes
        for kind in KINDS:
            srcs, dsts, exp = _batch(rng, src, peer, lengths)
            peer.poison()
            taken[kind] = _route_of(eng, lambda: eng.batch_write(peer.session, _as(kind, srcs), _as(kind, dsts),
                                                                 _as(kind, lengths)))
            peer.check(exp)
    assert len(set(map(str, taken.values()))) == 1, taken
    route = taken["list"]
    assert sum(route.values()) == 1, route
    if lengths is AUX:
        assert route == {"rows": 1}  # a few small host pieces on tcp: one framed post


def test_the_mooncake_api_takes_one_route_whatever_the_argument_type(peer, src, rng):
    from integration.mooncake import TransferEngine as MooncakeTransferEngine
    mc = MooncakeTransferEngine()
    try:
        assert mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert mc.register_memory(src.ctypes.data, src.size) == 0
        assert mc.transfer_sync_write(peer.session, src.ctypes.data, peer.base, 1) == 0  # handshakes
        for lengths, route in ((AUX, {"rows": 1}), (AUX[:5] + [0] + AUX[5:], {"rows": 1}), ([64] * 300, None),
                               ([64] * 150 + [0] + [100] * 149, None)):
            taken = {}
            for kind in KINDS:
                srcs, dsts, exp = _batch(rng, src, peer, [max(n, 1) for n in lengths])  # the empty piece: nothing
                if 0 in lengths:
                    k = lengths.index(0)
                    exp = Expected(peer.size)
                    exp.apply(src, [s - src.ctypes.data for i, s in enumerate(srcs) if i != k],
                              [d - peer.base for i, d in enumerate(dsts) if i != k], [n for n in lengths if n])
                peer.poison()
                args = (_as(kind, srcs), _as(kind, dsts), _as(kind, lengths))
                taken[kind] = _route_of(mc._engine, lambda: mc.batch_transfer_sync_write(peer.session, *args) == 0
                                        or pytest.fail(f"{kind}: batch_transfer_sync_write failed"))
                peer.check(exp)
            assert len(set(map(str, taken.values()))) == 1, (len(lengths), taken)
            assert route is None or taken["list"] == route, taken
    finally:
        mc.close()


@pytest.mark.parametrize("bad", [2.5, True, "7", -3])
def test_the_mooncake_api_refuses_a_bad_length_in_a_long_list_and_writes_nothing(peer, src, rng, bad):
    from integration.mooncake import ERR_INVALID_ARGUMENT, TransferEngine as MooncakeTransferEngine
    mc = MooncakeTransferEngine()
    try:
        assert mc.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert mc.register_memory(src.ctypes.data, src.size) == 0
        assert mc.transfer_sync_write(peer.session, src.ctypes.data, peer.base, 1) == 0  # handshakes
        lengths = [64] * 300
        srcs, dsts, _ = _batch(rng, src, peer, lengths)
        i = int(rng.integers(300))
        lengths[i] = bad
        if bad != -3:
            lengths[(i + 1 + int(rng.integers(299))) % 300] = 0  # a zero-length piece elsewhere changes nothing
        peer.poison()
        assert mc.batch_transfer_sync_write(peer.session, srcs, dsts, lengths) == ERR_INVALID_ARGUMENT
        peer.check(Expected(peer.size))  # poison everywhere: nothing written
    finally:
        mc.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_entry_is_named_and_nothing_written_whatever_the_type(peer, src, rng, kind):
    srcs, dsts, _ = _batch(rng, src, peer, AUX)
    with TransferEngine(fabric="tcp") as eng:
        eng.register(src)
        eng.batch_write(peer.session, [src.ctypes.data], [peer.base], [1])  # connected: every route is open
        peer.poison()
        bad_lengths = list(AUX)
        bad_lengths[4] = -5
        with pytest.raises(InvalidTransfer, match=r"lengths\[4\] = -5"):
            eng.batch_write(peer.session, _as(kind, srcs), _as(kind, dsts), _as(kind, bad_lengths))
        bad_dsts = list(dsts)
        bad_dsts[7] = -1
        with pytest.raises(InvalidTransfer, match=r"dsts\[7\] = -1 is negative"):
            eng.batch_write(peer.session, _as(kind, srcs), _as(kind, bad_dsts), _as(kind, AUX))
        if kind in ("array", "tensor"):
            floats = np.asarray(AUX, dtype=np.float64)
            with pytest.raises(InvalidTransfer, match=r"lengths\[0\] = 64.0 is not an int"):
                eng.batch_write(peer.session, _as(kind, srcs), _as(kind, dsts),
                                floats if kind == "array" else torch.from_numpy(floats))
        assert eng.stats()["batches"]["submitted"] == 1
    peer.check(Expected(peer.size))  # poison everywhere: nothing written
