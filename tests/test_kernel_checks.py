"""The argument checks of gather / scatter / copy (fast whole-array path against the per-piece reference), the
launch policy (table, PXN_KERNEL_POLICY file, plan cache), host index arrays and the staging pool that uploads
them, and what a CPU caller without the interpreter is told."""
import json
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import pxn_kernels
from pxn_kernels import _checks, policy
from kernel_helpers import (DEVICE, HAS_CUDA, bad_call_leaves_out_untouched, i64, packed_offsets, piece_sources,
                            random_bytes, valid_batch)

INT64_MAX = (1 << 63) - 1


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _reference(op, lengths, checks, written):
    """The per-piece checks alone (what the fast path must agree with): the error message, or None."""
    try:
        _checks.check_lengths(op, lengths)
        _checks._name_failure(op, lengths, checks, written)
    except ValueError as exc:
        return str(exc)
    return None


def _outcome(op, lengths, checks, written, tensors=None):
    try:
        stats = _checks.validate(op, lengths, checks, written=written, written_tensors=tensors)
    except ValueError as exc:
        return str(exc)
    assert (stats.lmin, stats.lmax, stats.total) == (int(lengths.min()), int(lengths.max()), int(lengths.sum()))
    return None


def _break(rng, lengths, addresses, starts, limit, how):
    lengths, addresses, starts = lengths.copy(), addresses.copy(), starts.copy()
    live = np.flatnonzero(lengths)
    i = int(rng.choice(live))
    if how == "negative_length":
        lengths[i] = -int(rng.integers(1, 5))
    elif how == "zero_address":
        addresses[i] = -int(rng.integers(0, 3))
    elif how == "overflow":
        addresses[i] = INT64_MAX - int(lengths[i]) + 1
    elif how == "negative_offset":
        starts[i] = -1
    elif how == "past_limit":
        starts[i] = limit - int(lengths[i]) + 1
    elif how == "huge_offset":  # start + length wraps past 2**63 (and would pass a naive order test)
        starts[i] = INT64_MAX - int(rng.integers(0, lengths[i]))
    elif how == "overlap" and live.size > 1:
        j = int(rng.choice(live[live != i]))
        starts[i] = starts[j] + int(rng.integers(0, lengths[j]))
    return lengths, addresses, starts


HOWS = ["none", "negative_length", "zero_address", "overflow", "negative_offset", "past_limit", "huge_offset",
        "overlap"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.sampled_from([1, 2, 5, 63, 64, 65, 300, 5000]), kind=st.sampled_from(["sorted", "rows", "sorted_rows", "mixed"]),
       how=st.sampled_from(HOWS), case_seed=st.integers(0, 1 << 30))
def test_fast_checks_agree_with_the_per_piece_checks(seed, n, kind, how, case_seed):
    """Python-int path (<= 64 pieces), numpy path, sorted and unordered written ranges, zero lengths: the
    fast checks reject exactly what the per-piece checks reject, with the same message (the first bad piece)."""
    rng = np.random.default_rng([seed, case_seed])
    lengths, addresses, starts, limit = valid_batch(rng, n, kind)
    if how != "none" and np.count_nonzero(lengths):
        lengths, addresses, starts = _break(rng, lengths, addresses, starts, limit, how)
    for op, checks, written in [
            ("gather", [_checks.address("src_ptrs", addresses), _checks.within("out_offsets", starts, limit, "out")],
             ("out_offsets", starts)),
            ("scatter", [_checks.within("src_offsets", starts, limit, "src"), _checks.address("dst_ptrs", addresses)],
             ("dst_ptrs", addresses + 0)),
            ("copy", [_checks.address("src_ptrs", addresses), _checks.address("dst_ptrs", starts + (1 << 40))],
             ("dst_ptrs", starts + (1 << 40)))]:
        assert _outcome(op, lengths, checks, written) == _reference(op, lengths, checks, written)


@pytest.mark.parametrize("n", [2, 5, 64, 65])
def test_ordered_rows_overlapping_their_neighbour_are_refused(rng, n):
    """Rows of one length in ascending order where one starts a byte before its neighbour ends (the order alone
    does not show it): refused, with the per-piece checks' message; one byte later they are accepted."""
    length = int(rng.integers(2, 300))
    lengths = np.full(n, length, dtype=np.int64)
    starts = np.cumsum(rng.integers(0, 3, n) + length).astype(np.int64) - length
    k = int(rng.integers(1, n))
    starts[k:] += starts[k - 1] + length - 1 - starts[k]  # piece k (and all after it) one byte early
    limit = int(starts[-1]) + length
    addresses = rng.integers(1, 1 << 46, n).astype(np.int64)
    for fix in (0, 1):
        starts[k:] += fix
        checks = [_checks.address("src_ptrs", addresses), _checks.within("out_offsets", starts, limit + fix, "out")]
        message = _outcome("gather", lengths, checks, ("out_offsets", starts))
        assert message == _reference("gather", lengths, checks, ("out_offsets", starts))
        assert (message is None) == bool(fix) and (fix or f"out_offsets[{k - 1}]" in message)


def test_unordered_overlap_found_on_wide_spans(rng):
    """Unordered ranges more than 4 GiB apart (64-bit sort keys), of one length and of mixed lengths."""
    for equal in (True, False):
        n = 200
        lengths = np.full(n, 4096, dtype=np.int64) if equal else rng.integers(1, 5000, n).astype(np.int64)
        starts = (rng.permutation(n).astype(np.int64) * (1 << 33)) + (1 << 40)
        checks = [_checks.address("dst_ptrs", starts)]
        assert _outcome("copy", lengths, checks, ("dst_ptrs", starts)) is None
        starts[17] = starts[5] + int(lengths[5]) - 1  # overlaps piece 5 by one byte
        message = _outcome("copy", lengths, checks, ("dst_ptrs", starts))
        assert message == _reference("copy", lengths, checks, ("dst_ptrs", starts)) and "overlaps" in message


@pytest.mark.parametrize("op", ["gather", "scatter", "copy"])
def test_public_calls_reject_an_overlap_among_unordered_rows(rng, op):
    """Rows written to random places (a scatter into a paged pool), one of them onto its neighbour: refused,
    nothing written; the same rows without the clash are copied byte-exact."""
    length, n = 48, 300
    pool = random_bytes(rng, length * 3 * n + 64)
    slots = rng.permutation(3 * n)[:n]
    dst = pool.data_ptr() + slots.astype(np.int64) * length
    src_buf, src = piece_sources(rng, [length] * n, [0])
    chunk = random_bytes(rng, n * length)
    offsets = np.arange(n, dtype=np.int64) * length
    bad = dst.copy()
    bad[n // 2] = bad[n // 3] + 8
    before = pool.clone()

    def call(d):
        if op == "scatter":
            pxn_kernels.scatter(chunk, i64(offsets), i64(d), i64([length] * n), backend="triton")
        elif op == "copy":
            pxn_kernels.copy(i64(src), i64(d), i64([length] * n), backend="triton")
        else:  # gather writes its chunk: the clash is in out_offsets
            o = offsets.copy()
            o[n // 2] = o[n // 3] + 8
            pxn_kernels.gather(i64(src), i64([length] * n), pool, i64(o if d is bad else offsets), backend="triton")
    with pytest.raises(ValueError, match="overlaps"):
        call(bad)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(pool, before)
    call(dst)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    if op == "scatter":
        for i, s in enumerate(slots):
            assert torch.equal(pool[s * length:(s + 1) * length], chunk[i * length:(i + 1) * length])


def test_host_index_arrays_are_accepted(rng):
    """numpy int64 arrays as index arguments (converted without a copy on the CPU; one upload on a GPU)."""
    lengths = [5, 64, 1, 300]
    src_buf, src = piece_sources(rng, lengths, [0, 3])
    out = random_bytes(rng, 512)
    ref = out.clone()
    offsets = [0, 16, 100, 200]
    as_np = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    pxn_kernels.gather(as_np(src), as_np(lengths), out, as_np(offsets), backend="triton")
    pxn_kernels.gather_torch(i64(src), i64(lengths), ref, i64(offsets))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="lengths must be int64, got int32" if HAS_CUDA else "lengths must be"):
        pxn_kernels.gather(as_np(src), np.asarray(lengths, dtype=np.int32), out, as_np(offsets), backend="triton")


@pytest.mark.gpu
def test_host_index_arrays_for_a_gpu_copy(rng):
    """Host arrays (numpy and CPU tensors) with a GPU output: checked on the host, uploaded once, byte-exact;
    rows of one length take the row kernel from the host lengths."""
    for lengths in ([5, 64, 1, 300, 4097], [256] * 33):
        src_buf, src = piece_sources(rng, lengths, [0, 3])
        offsets = np.cumsum([0] + [x + 16 for x in lengths[:-1]]).astype(np.int64)
        out = random_bytes(rng, int(offsets[-1]) + lengths[-1] + 16)
        ref = out.clone()
        pxn_kernels.gather(np.asarray(src, dtype=np.int64), torch.tensor(lengths), out, offsets)
        pxn_kernels.gather_torch(i64(src), i64(lengths), ref, i64(offsets.tolist()))
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_triton_backend_on_cpu_without_the_interpreter_says_what_to_do(rng, monkeypatch):
    import sys
    gather_mod = sys.modules["pxn_kernels.gather"]  # (the package's ``gather`` attribute is the function)
    monkeypatch.setattr(gather_mod, "_batched_copy_kernel", object())  # a compiled (not interpreted) kernel
    out = torch.zeros(64, dtype=torch.uint8)
    src = torch.arange(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1 .* or use backend='auto' / 'host'"):
        pxn_kernels.gather(torch.tensor([src.data_ptr()]), torch.tensor([8]), out, torch.tensor([0]),
                           backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        pxn_kernels.copy(torch.tensor([src.data_ptr()]), torch.tensor([out.data_ptr()]), torch.tensor([8]),
                         backend="triton")
    assert not out.any()
    pxn_kernels.gather(torch.tensor([src.data_ptr()]), torch.tensor([8]), out, torch.tensor([0]))  # auto: memmove
    assert out[:8].tolist() == list(range(8))


# --- the launch policy ------------------------------------------------------------------------------------

@pytest.fixture
def clean_policy():
    yield
    policy.set_override(None)


def test_policy_file_overrides_and_validation(tmp_path, monkeypatch, clean_policy):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"_note": "test", "sm_90": {"row": {"max_bytes": 100}},
                                "grid": {"num_warps": 4}}))
    monkeypatch.setenv("PXN_KERNEL_POLICY", str(path))
    policy.set_override(None)  # read the environment again
    monkeypatch.setattr(policy, "arch_name", lambda device: "sm_90")
    got = policy.policy(torch.device("cuda", 0))
    assert got["row"]["max_bytes"] == 100 and got["grid"]["num_warps"] == 4
    assert got["row"]["classes"] == policy.defaults("sm_90")["row"]["classes"]  # untouched entries kept
    monkeypatch.setattr(policy, "arch_name", lambda device: "sm_80")
    assert policy.policy(torch.device("cuda", 0))["row"]["max_bytes"] == policy.defaults()["row"]["max_bytes"]
    for bad, message in [({"rows": {}}, "unknown key policy.rows"),
                         ({"grid": {"num_warps": "4"}}, "grid.num_warps must be a non-negative integer"),
                         ({"sm_90": {"row": {"classes": [{"up_to": 64}]}}}, r"lacks max_cols, num_warps, tile_bytes"),
                         ({"range_small": {"shift": 1}}, "shift must be true or false"),
                         ({"row": {"classes": [{"up_to": 64, "tile_bytes": 1024, "max_cols": 64, "num_warps": 1,
                                                "split": 1}]}}, r"classes\[0\]\.split must be true or false"),
                         ([1, 2], "must hold a JSON object")]:
        with pytest.raises(ValueError, match=message):
            policy.parse(json.dumps(bad))
    monkeypatch.setenv("PXN_KERNEL_POLICY", str(tmp_path / "missing.json"))
    policy.set_override(None)
    with pytest.raises(ValueError, match="cannot read it"):
        policy.policy(torch.device("cuda", 0))


def test_policy_picks_the_kernel_and_the_plan_cache_follows_it(clean_policy):
    lengths = np.full(50, 256, dtype=np.int64)
    assert pxn_kernels.plan_for_lengths(lengths, DEVICE).kernel == "row"
    policy.set_override({"*": {"row": {"enabled": False}}})
    if DEVICE.type == "cuda":  # (the interpreter's plans do not follow the GPU policy)
        assert pxn_kernels.plan_for_lengths(lengths, DEVICE).kernel == "segment"
        policy.set_override({"*": {"row": {"enabled": False}, "segment": {"enabled": False}}})
        assert pxn_kernels.plan_for_lengths(lengths, DEVICE).kernel == "range"
    policy.set_override(None)
    mixed = np.array([5, 64, 300, 17] * 10, dtype=np.int64)
    first = pxn_kernels.plan_for_lengths(mixed, DEVICE)
    assert pxn_kernels.plan_for_lengths(mixed.copy(), DEVICE) is first  # cached by the lengths themselves
    swapped = mixed.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same count and sum, other order: another plan
    other = pxn_kernels.plan_for_lengths(swapped, DEVICE)
    assert other is not first
    if DEVICE.type == "cuda":
        assert other.kernel == "segment" and other.segments.numel() == mixed.size
    else:
        assert other.pad_ends.cpu().tolist()[:2] == [64, 80]


def test_plan_cache_of_long_lists_keyed_by_the_checks_stats_keeps_each_order(rng):
    """Long length lists with the checks' stats share a key per (count, min, max, sum): the same multiset in
    other orders must still get a plan of its own, each found again by its bytes, and a changed list never
    gets a stale plan."""
    base = rng.integers(1, 9000, 700).astype(np.int64)
    stats = _checks.LengthStats(int(base.min()), int(base.max()), int(base.sum()))
    orders = [base] + [rng.permutation(base) for _ in range(3)]
    plans = [pxn_kernels.plan_for_lengths(o, DEVICE, stats) for o in orders]
    assert len({id(p) for p in plans}) == len(orders)
    for _ in range(2):
        for o, p in zip(orders, plans):
            assert pxn_kernels.plan_for_lengths(o.copy(), DEVICE, stats) is p
    fresh = pxn_kernels.plan_for_lengths(base, DEVICE)  # no stats: found by the fingerprint, another entry
    inner = np.flatnonzero((base > stats.lmin + 1) & (base < stats.lmax - 1))  # moving them keeps min and max
    changed = base.copy()
    changed[inner[0]] += 1
    changed[inner[1]] -= 1  # same count, min, max and sum
    got = pxn_kernels.plan_for_lengths(changed, DEVICE, stats)
    assert all(got is not p for p in plans + [fresh])


def test_disjoint_on_device_agrees_with_the_host_sort(rng):
    """The GPU overlap test (torch.sort, one flag) on CPU tensors here: same answer as the host sort."""
    for trial in range(40):
        n = int(rng.integers(2, 400))
        equal = trial % 2 == 0
        lengths = np.full(n, 64, dtype=np.int64) if equal else rng.integers(1, 200, n).astype(np.int64)
        starts = rng.permutation(n * 4)[:n].astype(np.int64) * 64 + (1 << 30)
        if trial % 3 == 0:
            starts[int(rng.integers(0, n))] = starts[int(rng.integers(0, n))] + int(rng.integers(0, 64))
        want = _checks._disjoint_sorted(starts, starts + lengths, 64 if equal else 0)
        got = _checks._disjoint_on_device(torch.from_numpy(starts), torch.from_numpy(lengths), 64 if equal else 0)
        assert got == want == (_reference("copy", lengths, [], ("dst_ptrs", starts)) is None)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [64, 100])
def test_large_unordered_scatter_checked_on_the_gpu(rng, length):
    """From 4096 pieces, unordered written ranges are sorted on the GPU, or, for rows of one power-of-two length
    on their grid, told apart by the bitmap of slots: an overlap (half a row off the grid, or the same slot
    twice) is refused with the usual message and nothing written; the batch without it is scattered
    byte-exact."""
    n = 5000
    pool = random_bytes(rng, length * 2 * n)
    slots = torch.randperm(2 * n, device=DEVICE)[:n]
    dst = pool.data_ptr() + slots * length
    chunk = random_bytes(rng, n * length)
    offsets = torch.arange(n, dtype=torch.int64, device=DEVICE) * length
    lengths = torch.full((n,), length, dtype=torch.int64, device=DEVICE)
    before = pool.clone()
    for shift in (length // 2, 0):
        bad = dst.clone()
        bad[4321] = bad[17] + shift
        with pytest.raises(ValueError, match=r"dst_ptrs\[\d+\] = \d+ \(length \d+\) overlaps"):
            pxn_kernels.scatter(chunk, offsets, bad, lengths)
        torch.cuda.synchronize()
        assert torch.equal(pool, before)
    pxn_kernels.scatter(chunk, offsets, dst, lengths)
    before.view(2 * n, length).index_copy_(0, slots, chunk.view(n, length))
    torch.cuda.synchronize()
    assert torch.equal(pool, before)


def test_direct_launcher_passes_grid_values_and_stream(monkeypatch):
    """The direct launcher's two paths (shared parameter buffer; a binding with its own) hand the driver the
    grid, block, stream and every argument value, 64- and 32-bit, read back through the parameter pointers."""
    import ctypes
    from pxn_kernels import _direct_launch as dl
    calls = []

    class FakeDriver:
        @staticmethod
        def cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            kinds = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int64]
            values = [ctypes.cast(params[i], ctypes.POINTER(k)).contents.value for i, k in enumerate(kinds)]
            calls.append((gx, gy, bx, shared, stream, values))
            return 0

    monkeypatch.setattr(dl, "driver", lambda: FakeDriver)
    launcher = dl.DirectLauncher(1234, [8, 8, 4, 8], n_user=3, num_warps=4, shared=0)
    launcher.launch(7, 99, [1 << 40, -5, 123], grid_y=3)
    enqueue = launcher.bind(11, 2, [1 << 41, 6, (1 << 31) - 1])
    launcher.launch(8, 98, [1, 2, 3])  # the shared buffer changes; the binding keeps its own values
    enqueue(97)
    current = launcher.bind_current(5, 3, [7, -8, 9], lambda: 96)  # reads the stream itself at each call
    launcher.launch(8, 98, [4, 5, 6])
    current()
    assert calls == [(7, 3, 128, 0, 99, [1 << 40, -5, 123, 0]), (8, 1, 128, 0, 98, [1, 2, 3, 0]),
                     (11, 2, 128, 0, 97, [1 << 41, 6, (1 << 31) - 1, 0]), (8, 1, 128, 0, 98, [4, 5, 6, 0]),
                     (5, 3, 128, 0, 96, [7, -8, 9, 0])]


def test_a_failed_direct_launch_names_the_call_and_the_code(monkeypatch):
    """A CUresult other than CUDA_SUCCESS from either launch path raises a RuntimeError naming cuLaunchKernel
    and the code."""
    from pxn_kernels import _direct_launch as dl, _libcuda

    class FailingDriver:
        @staticmethod
        def cuLaunchKernel(*args):
            return 719

    monkeypatch.setattr(dl, "driver", lambda: FailingDriver)
    monkeypatch.setattr(_libcuda, "error_name", {719: "CUDA_ERROR_LAUNCH_FAILED"}.get)
    launcher = dl.DirectLauncher(1234, [8, 4], n_user=2, num_warps=1, shared=0)
    with pytest.raises(RuntimeError, match=r"^cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED \(719\)$"):
        launcher.launch(1, 0, [1, 2])
    with pytest.raises(RuntimeError, match=r"^cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED \(719\)$"):
        launcher.bind(1, 1, [1, 2])(0)
    with pytest.raises(RuntimeError, match=r"^cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED \(719\)$"):
        launcher.bind_current(1, 1, [1, 2], lambda: 0)()


def test_driver_errors_name_the_call_the_code_and_what_it_was_for(monkeypatch):
    """``_libcuda.check``: nothing for CUDA_SUCCESS; else a CudaDriverError (a RuntimeError) carrying the call,
    the code and its name, or the caller's exception type with the same message (gpu_copy: TransferError)."""
    from pxn_kernels import _libcuda
    from transport.errors import TransferError
    from transport.fabric import gpu_copy
    monkeypatch.setattr(_libcuda, "error_name", {700: "CUDA_ERROR_ILLEGAL_ADDRESS"}.get)
    _libcuda.check(0, "cuGraphLaunch")
    with pytest.raises(_libcuda.CudaDriverError) as got:
        _libcuda.check(700, "cuMemcpyHtoDAsync", "index upload")
    assert str(got.value) == "index upload: cuMemcpyHtoDAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"
    assert isinstance(got.value, RuntimeError)
    assert (got.value.call, got.value.code, got.value.name) == ("cuMemcpyHtoDAsync", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    with pytest.raises(_libcuda.CudaDriverError, match=r"^cuEventQuery failed: CUresult 12345$"):
        _libcuda.check(12345, "cuEventQuery")  # a code the driver has no name for
    with pytest.raises(TransferError) as got:
        gpu_copy._check(700, "cuGraphLaunch", "batched copy graph launch")
    assert str(got.value) == "batched copy graph launch: cuGraphLaunch failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"
    assert not isinstance(got.value, RuntimeError) and got.value.__cause__.code == 700


def test_driver_error_without_a_driver_keeps_the_code(monkeypatch):
    """Where libcuda cannot be loaded, ``driver()`` raises the loader's OSError naming the library, and an error
    check still reports the call and the number."""
    from pxn_kernels import _libcuda
    monkeypatch.setattr(_libcuda, "_LIBRARY", "libcuda-not-here.so.1")
    monkeypatch.setattr(_libcuda, "_lib", None)
    with pytest.raises(OSError, match="libcuda-not-here.so.1"):
        _libcuda.driver()
    with pytest.raises(RuntimeError, match=r"^cuStreamSynchronize failed: CUresult 700$"):
        _libcuda.check(700, "cuStreamSynchronize")


@pytest.mark.slow
def test_importing_pxn_does_not_load_libcuda():
    """The driver is loaded on first use, never at import: pxn imports on machines without a GPU driver (CI).
    A fresh interpreter, since this one may have loaded it for earlier tests."""
    import subprocess
    import sys
    code = ("import transport, transport.engine, transport.fabric.gpu_copy, transport.fabric.ipc, pxn_kernels, "
            "pxn_kernels._staging, pxn_kernels._direct_launch, pxn_kernels._libcuda as lc; "
            "assert lc._lib is None, lc._lib")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("n", [5, 300])
def test_a_wrapping_offset_inside_an_ordered_batch_is_refused(n):
    """An offset near 2**63 in the middle of ascending offsets: its end wraps negative and would pass a naive
    'each ends before the next starts' test; the checks must still name it."""
    lengths = np.full(n, 16, dtype=np.int64)
    offsets = np.arange(n, dtype=np.int64) * 16
    offsets[n // 2] = INT64_MAX - 3
    addresses = np.arange(1, n + 1, dtype=np.int64) << 20
    checks = [_checks.address("src_ptrs", addresses), _checks.within("out_offsets", offsets, 16 * n, "out")]
    with pytest.raises(ValueError, match=rf"out_offsets\[{n // 2}\] = {INT64_MAX - 3} \+ lengths\[{n // 2}\] = 16 "
                                         rf"runs past out"):
        _checks.validate("gather", lengths, checks, written=("out_offsets", offsets))


def test_lean_path_accepts_only_what_the_full_path_accepts():
    """The unchecked-call shortcut takes a call only when every argument is what the full path accepts without
    a copy (on the CPU: only the "triton" backend under the interpreter, never "auto", the memmove path);
    anything else goes the full way (which raises with the name)."""
    import sys
    lean = sys.modules["pxn_kernels._batched_copy"]._lean
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    buf = torch.zeros(64, dtype=torch.uint8)
    assert not lean(buf, t(1), t(1), t(1), "auto")  # CPU: the memmove path
    interpreted = sys.modules["pxn_kernels._batched_copy"]._INTERPRETED  # CPU tests: True; a GPU box: False
    assert lean(buf, t(1), t(1), t(1), "triton") == interpreted
    assert not lean(buf, t(1), t(1, 2), t(1), "triton") and not lean(buf.view(8, 8).t(), t(1), t(1), t(1), "triton")
    assert not lean(buf, t(1), t(1).to(torch.int32), t(1), "triton") and not lean(buf, t(1), t(1), t(1), "host")
    assert not lean(buf, [1], t(1), t(1), "auto")
    if HAS_CUDA:
        g = lambda *v: torch.tensor(v, dtype=torch.int64, device="cuda")  # noqa: E731
        gbuf = buf.cuda()
        assert lean(gbuf, g(1), g(2), g(3), "auto") and lean(None, g(1), g(2), g(3), "triton")
        for args in [(gbuf, g(1), g(1, 2), g(1)), (gbuf.view(8, 8).t(), g(1), g(1), g(1)),
                     (gbuf.to(torch.int16), g(1), g(1), g(1)), (gbuf, g(1).to(torch.int32), g(1), g(1)),
                     (gbuf, g(1), t(1), g(1)), (gbuf, g(1), g(1).view(1, 1), g(1))]:
            assert not lean(*args, "auto")
        assert not lean(gbuf, g(1), g(1), g(1), "gpu") and not lean(gbuf, g(1), g(1), g(1), "host")


# --- host index arrays, and the staging pool that uploads them ------------------------------------------------

def _np(values):
    return np.asarray(values, dtype=np.int64)


def _distinct_pieces(rng, lengths, misalign):
    """A source buffer whose pieces (at the given misalignments) each hold values no other piece holds in the
    same position (piece i, byte j: (i + 7 j) mod 256 xor a random byte shared by all), and the addresses."""
    buf, addrs = piece_sources(rng, lengths, misalign)
    salt = int(rng.integers(0, 256))
    for i, (addr, length) in enumerate(zip(addrs, lengths)):
        s = addr - buf.data_ptr()
        pattern = (torch.arange(length, dtype=torch.int64) * 7 + i) % 256 ^ salt
        buf[s:s + length] = pattern.to(torch.uint8).to(buf.device)
    return buf, addrs


HOST_CASES = [[1, 63, 5, 64, 17, 300, 0, 129, 2], [63] * 19, [1] * 7, [100] * 70]


@pytest.mark.parametrize("lengths", HOST_CASES, ids=["mixed", "63B-rows", "1B-rows", "100B-rows-numpy-checks"])
def test_host_index_arrays_byte_exact_for_every_entry(rng, lengths):
    """gather / scatter / copy with numpy index arrays (on a GPU: checked on the host, uploaded through the
    staging pool): odd lengths at unaligned places, distinct values per piece, poisoned outputs, byte-exact
    against the torch references; scatter's destinations in random order."""
    n = len(lengths)
    src_buf, src = _distinct_pieces(rng, lengths, [1, 3, 0, 7, 9])
    offsets, size = packed_offsets(lengths, misalign=5, gap=3)
    out = random_bytes(rng, size + 16)
    ref = out.clone()
    pxn_kernels.gather(_np(src), _np(lengths), out, _np(offsets), backend="triton")
    pxn_kernels.gather_torch(i64(src), i64(lengths), ref, i64(offsets))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)

    order = rng.permutation(n)
    back = random_bytes(rng, src_buf.numel())
    expect = back.clone()
    rel = [src[i] - src_buf.data_ptr() for i in order]
    pxn_kernels.scatter(out, _np([offsets[i] for i in order]), _np([back.data_ptr() + r for r in rel]),
                        _np([lengths[i] for i in order]), backend="triton")
    pxn_kernels.scatter_torch(ref, i64([offsets[i] for i in order]), i64([expect.data_ptr() + r for r in rel]),
                              i64([lengths[i] for i in order]))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(back, expect)
    for i, r in zip(order, rel):  # the references moved the pieces themselves
        assert torch.equal(expect[r:r + lengths[i]], src_buf[r:r + lengths[i]])

    again = random_bytes(rng, src_buf.numel())
    expect_again = again.clone()
    pxn_kernels.copy(_np(src), _np([again.data_ptr() + a - src_buf.data_ptr() for a in src]), _np(lengths),
                     backend="triton", device=DEVICE)
    pxn_kernels.copy_torch(i64(src), i64([expect_again.data_ptr() + a - src_buf.data_ptr() for a in src]),
                           i64(lengths))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(again, expect_again)


def test_host_index_arrays_refused_with_the_value_and_nothing_written(rng):
    """Every bad host argument is refused with a ValueError naming the argument and value, before anything
    is uploaded or launched: the output and the destinations keep their poison."""
    src = random_bytes(rng, 256)
    p = src.data_ptr()
    as32 = lambda v: np.asarray([x & 0x7fffffff for x in v], dtype=np.int32)  # noqa: E731
    g, s, c = pxn_kernels.gather, pxn_kernels.scatter, pxn_kernels.copy
    cases = [
        (lambda o: g(_np([p, p + 8]), _np([8, -1]), o, _np([0, 8]), backend="triton"),
         r"lengths\[1\] = -1 is negative"),
        (lambda o: g(_np([p, p + 8]), _np([8, 8]), o, _np([0, 250]), backend="triton"),
         r"out_offsets\[1\] = 250 \+ lengths\[1\] = 8 runs past out \(256 bytes\)"),
        (lambda o: g(_np([p]), _np([8]), o, _np([-3]), backend="triton"), r"out_offsets\[0\] = -3 is negative"),
        (lambda o: g(_np([p, p + 8, p + 16]), _np([8, 8, 8]), o, _np([0, 16, 20]), backend="triton"),
         r"out_offsets\[1\] = 16 \(length 8\) overlaps out_offsets\[2\] = 20"),
        (lambda o: g(_np([0]), _np([8]), o, _np([0]), backend="triton"), r"src_ptrs\[0\] = 0 is not a valid"),
        (lambda o: g(as32([p]), _np([8]), o, _np([0]), backend="triton"), "src_ptrs must be int64, got int32"),
        (lambda o: g(_np([p]), as32([8]), o, _np([0]), backend="triton"), "lengths must be int64, got int32"),
        (lambda o: g(_np([p, p]), _np([8]), o, _np([0, 8]), backend="triton"), "lengths has 1 items but"),
        (lambda o: s(src, _np([0, 8]), _np([o.data_ptr() + 40, o.data_ptr()]), _np([8, 41]), backend="triton"),
         r"dst_ptrs\[1\] = \d+ \(length 41\) overlaps dst_ptrs\[0\]"),
        (lambda o: s(src, _np([250]), _np([o.data_ptr()]), _np([8]), backend="triton"),
         r"src_offsets\[0\] = 250 \+ lengths\[0\] = 8 runs past src"),
        (lambda o: s(src, _np([0]), as32([o.data_ptr()]), _np([8]), backend="triton"),
         "dst_ptrs must be int64, got int32"),
        (lambda o: c(_np([p]), _np([o.data_ptr()]), _np([-2]), backend="triton", device=DEVICE),
         r"lengths\[0\] = -2 is negative"),
        (lambda o: c(_np([p]), _np([(1 << 63) - 4]), _np([8]), backend="triton", device=DEVICE),
         r"dst_ptrs\[0\] = 0x7ffffffffffffffc \+ 8 overflows"),
        (lambda o: c(_np([p] * 100), _np([o.data_ptr() + 2 * i for i in range(100)]), _np([2] * 98 + [3, 2]),
                     backend="triton", device=DEVICE),
         r"dst_ptrs\[98\] = \d+ \(length 3\) overlaps dst_ptrs\[99\]"),
    ]
    for call, match in cases:
        bad_call_leaves_out_untouched(rng, call, match)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_index_args_take_plain_arguments_as_they_are_and_name_the_rest(device):
    """The one-pass acceptance of plain index arguments (contiguous 1-D int64 numpy arrays, or such tensors on
    the copy's device): those pass as the very objects given (host copies of numpy arrays are the arrays); a
    strided view, another dtype, shape, device, count or a tensor subclass goes the general way, which copies
    a strided view flat and names everything else. ``device`` "cuda": only its type matters for numpy
    arrays; tensors need the GPU."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    arrays = dict(src_ptrs=_np([1 << 20, 2 << 20, 3 << 20]), lengths=_np([4, 5, 6]), out_offsets=_np([0, 8, 16]))
    args = _checks.index_args("gather", dev, **arrays)
    assert args.count == 3 and args.on_host == (device == "cuda")
    assert all(a is b for a, b in zip(args.host(), arrays.values()))
    if device == "cpu":
        assert [v.tolist() for v in args.values.values()] == [a.tolist() for a in arrays.values()]
        assert all(v.data_ptr() == a.ctypes.data for v, a in zip(args.values.values(), arrays.values()))
    if device == "cuda" and not HAS_CUDA:
        return
    tensors = {k: torch.from_numpy(a).to(dev) for k, a in arrays.items()}
    args = _checks.index_args("gather", dev, **tensors)
    assert args.count == 3 and not args.on_host and all(a is b for a, b in zip(args.values.values(),
                                                                                tensors.values()))
    strided = torch.arange(6, dtype=torch.int64, device=dev)[::2]
    args = _checks.index_args("gather", dev, **dict(tensors, out_offsets=strided))
    assert args.values["out_offsets"].is_contiguous() and args.values["out_offsets"].tolist() == [0, 2, 4]

    class Sub(torch.Tensor):
        pass

    sub = tensors["lengths"].as_subclass(Sub)
    assert _checks.index_args("gather", dev, **dict(tensors, lengths=sub)).count == 3  # accepted the general way
    for bad, match in [(dict(lengths=tensors["lengths"].to(torch.int32)), "lengths must be int64, got torch.int32"),
                       (dict(lengths=tensors["lengths"].view(3, 1)), r"lengths must be 1-D, got shape \(3, 1\)"),
                       (dict(out_offsets=tensors["out_offsets"][:2]), "out_offsets has 2 items but src_ptrs has 3"),
                       (dict(src_ptrs=tensors["src_ptrs"].to("meta")), "src_ptrs is on meta")]:
        with pytest.raises(ValueError, match=match):
            _checks.index_args("gather", dev, **dict(tensors, **bad))


def test_index_args_for_a_gpu_copy_keep_host_arrays_on_the_host():
    """For a GPU copy (only the device's type matters here, so this runs anywhere) host arrays and CPU tensors
    stay host arrays (one contiguous int64 array each, no copy of a contiguous one), and a bad one is named;
    GPU-side tensors of another device are refused by name."""
    cuda = torch.device("cuda", 0)
    src, lengths = _np([1 << 20, 2 << 20, 3 << 20]), torch.tensor([4, 5, 6])
    offsets = np.arange(6, dtype=np.int64)[::2]  # strided: made contiguous
    args = _checks.index_args("gather", cuda, src_ptrs=src, lengths=lengths, out_offsets=offsets)
    assert args.on_host and args.count == 3 and list(args.values) == ["src_ptrs", "lengths", "out_offsets"]
    got = args.host()
    assert got[0] is src and got[1].tolist() == [4, 5, 6] and got[2].tolist() == [0, 2, 4]
    assert all(a.dtype == np.int64 and a.flags.c_contiguous for a in got)
    for kwargs, match in [
            (dict(src_ptrs=src.astype(np.int32), lengths=lengths, out_offsets=offsets),
             "src_ptrs must be int64, got int32"),
            (dict(src_ptrs=src, lengths=lengths.view(3, 1), out_offsets=offsets),
             r"lengths must be 1-D, got shape \(3, 1\)"),
            (dict(src_ptrs=src, lengths=lengths, out_offsets=offsets[:2]),
             "out_offsets has 2 items but src_ptrs has 3"),
            (dict(src_ptrs=src, lengths=torch.tensor([4, 5, 6]).to("meta"), out_offsets=offsets),
             "src_ptrs must be an int64 torch.Tensor, got ndarray")]:
        with pytest.raises(ValueError, match=match):
            _checks.index_args("gather", cuda, **kwargs)


def test_unordered_rows_of_a_power_of_two_checked_by_slot(rng):
    """Rows of 2**k bytes on their grid (a paged pool) are checked with a bitmap of slots instead of a sort:
    same answers as the per-piece checks for disjoint rows, a repeated slot, a row off the grid (sorted
    instead), over 16 slots per row (sorted instead)."""
    for length in (1, 64, 2048):
        for n in (65, 300, 4100):
            lengths = np.full(n, length, dtype=np.int64)
            base = (1 << 40) + length * int(rng.integers(0, 1000))
            slots = rng.permutation(3 * n)[:n].astype(np.int64)
            for how in ("disjoint", "repeat", "off_grid_overlap", "off_grid_clear", "wide"):
                starts = base + slots * length
                if how == "repeat":
                    starts[int(rng.integers(0, n))] = starts[int(rng.integers(0, n))]
                elif how == "off_grid_overlap" and length > 1:
                    i, j = rng.choice(n, 2, replace=False)
                    starts[i] = starts[j] + length // 2
                elif how == "off_grid_clear" and length > 1:  # off the grid, in a free slot (maybe touching the next)
                    free = np.setdiff1d(np.arange(3 * n), slots)
                    starts[int(rng.integers(0, n))] = base + int(rng.choice(free)) * length + 1
                elif how == "wide":
                    starts = base + slots * length * 32
                checks = [_checks.address("dst_ptrs", starts)]
                want = _reference("copy", lengths, checks, ("dst_ptrs", starts))
                assert _outcome("copy", lengths, checks, ("dst_ptrs", starts)) == want
                if how == "disjoint" or how == "wide":
                    assert want is None
                if how == "repeat" and int(np.unique(starts).size) < n:
                    assert want is not None and "overlaps" in want
        lo, hi = 1 << 40, (1 << 40) + 4 * length
        assert _checks._distinct_slots(np.array([lo, hi], np.int64), lo, hi, length) is True
        assert _checks._distinct_slots(np.array([lo, lo], np.int64), lo, lo, length) is False
        assert _checks._distinct_slots(np.array([lo, lo + 3], np.int64), lo, lo + 3, 3) is None  # not 2**k


def test_spans_of_the_checks_and_reachable_by_span(monkeypatch):
    """The checks return each address argument's lowest and highest start (pieces of length 0 left out);
    reachable classifies a span inside one cached allocation without looking at each address, and falls back
    to the per-address lookup for a span across allocations."""
    from pxn_kernels import peer_access
    for n in (5, 300):
        addrs = (np.arange(n, dtype=np.int64)[::-1] * 4096) + (1 << 40)
        lengths = np.full(n, 16, dtype=np.int64)
        lengths[0] = 0  # the highest address, but empty
        stats = _checks.validate("copy", lengths, [_checks.address("src_ptrs", addrs),
                                                   _checks.address("dst_ptrs", addrs + (1 << 41))],
                                 written=("dst_ptrs", addrs + (1 << 41)))
        assert stats.spans["src_ptrs"] == (1 << 40, (1 << 40) + (n - 2) * 4096)
        assert stats.spans["dst_ptrs"] == ((1 << 40) + (1 << 41), (1 << 40) + (1 << 41) + (n - 2) * 4096)
    looked_up = []
    monkeypatch.setattr(peer_access, "_ranges", peer_access._RangeCache())
    monkeypatch.setattr(peer_access, "_driver_lookup", lambda a: looked_up.append(a) or (a, a + 1, -1))
    enabled = []
    monkeypatch.setattr(peer_access, "ensure_peer_access", lambda dev, peers: enabled.append((dev, sorted(peers))))
    peer_access._ranges.insert(1 << 40, (1 << 40) + (1 << 30), 0)
    peer_access._ranges.insert(1 << 42, (1 << 42) + (1 << 30), 1)
    cuda0 = torch.device("cuda", 0)
    inside = np.array([(1 << 40) + 64, (1 << 40) + 4096], dtype=np.int64)
    ones = np.ones(2, dtype=np.int64)
    assert peer_access._ranges.device_of_span(int(inside.min()), int(inside.max())) == 0
    assert peer_access.reachable(cuda0, [inside], ones, [(int(inside.min()), int(inside.max()))])
    assert looked_up == [] and enabled == []
    on_peer = inside + (1 << 42) - (1 << 40)
    assert peer_access.reachable(cuda0, [inside, on_peer], ones, [(int(inside.min()), int(inside.max())),
                                                                  (int(on_peer.min()), int(on_peer.max()))])
    assert looked_up == [] and enabled == [(0, [1])]
    across = np.array([(1 << 40) + 64, (1 << 42) + 64], dtype=np.int64)  # two allocations: each address looked at
    enabled.clear()
    assert peer_access._ranges.device_of_span(int(across.min()), int(across.max())) is None
    assert peer_access.reachable(cuda0, [across], ones, [(int(across.min()), int(across.max()))])
    assert looked_up == [] and enabled == [(0, [1])]  # both in cached ranges: no driver call
    host = np.array([7 << 20], dtype=np.int64)
    assert peer_access.reachable(cuda0, [host], np.ones(1, dtype=np.int64), [(7 << 20, 7 << 20)])
    assert looked_up == [7 << 20]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gather_of_host_arrays_captured_in_a_cuda_graph_replays_its_own_descriptors(rng):
    """Under graph capture the staging pool declines (its slots are reused by later calls, which a replay would
    read) and the call stages its descriptors in buffers of its own: a replay after other host-array calls
    still copies the captured pieces, byte for byte."""
    lengths = rng.integers(1, 700, 37).astype(np.int64)
    src_buf, src_addrs = piece_sources(rng, lengths.tolist(), [3, 0, 61])
    offsets, size = packed_offsets(lengths.tolist(), 5, 0)
    out = torch.zeros(size + 64, dtype=torch.uint8, device=DEVICE)
    ptrs, lens, offs = np.asarray(src_addrs, dtype=np.int64), lengths, np.asarray(offsets, dtype=np.int64)
    pxn_kernels.gather(ptrs, lens, out, offs)  # compiled and planned before the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            pxn_kernels.gather(ptrs, lens, out, offs)
    # other host-array calls reuse every pool slot meanwhile
    other_lens = np.roll(lens, 1)
    other_offs = np.asarray(packed_offsets(other_lens.tolist(), 5, 0)[0], dtype=np.int64)
    scratch = torch.empty_like(out)
    for _ in range(40):
        pxn_kernels.gather(np.roll(ptrs, 1), other_lens, scratch, other_offs)
    src_buf.copy_(random_bytes(rng, src_buf.numel()))  # fresh source bytes: the replay must read them
    poison = random_bytes(rng, out.numel())
    out.copy_(poison)
    graph.replay()
    torch.cuda.synchronize()
    want = poison.clone()
    pxn_kernels.gather_torch(torch.from_numpy(ptrs).to(DEVICE), torch.from_numpy(lens).to(DEVICE), want,
                             torch.from_numpy(offs).to(DEVICE))
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_host_array_calls_queued_behind_a_busy_stream_each_read_their_own_descriptors(rng):
    """Small host-array uploads reuse one device buffer per thread and stream: with the stream held busy, many
    gathers with different pieces queue up before any runs, each upload behind the kernel before it; two threads
    on streams of their own do the same at once. Every output must hold its own call's pieces."""
    def run(seed, results):
        local = np.random.default_rng(seed)
        calls = []
        for _ in range(12):  # buffers made first: a pageable copy onto the busy stream would wait for it
            lengths = local.integers(1, 300, int(local.integers(1, 60))).astype(np.int64)
            src_buf, src_addrs = piece_sources(local, lengths.tolist(), [1, 0, 7])
            offsets, size = packed_offsets(lengths.tolist(), 3, 1)
            out = random_bytes(local, size + 16)
            ptrs, offs = np.asarray(src_addrs, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
            calls.append((src_buf, ptrs, lengths, offs, out, out.clone()))
        for _, ptrs, lengths, offs, out, _ in calls:  # each kernel variant compiled and each plan made before
            pxn_kernels.gather(ptrs, lengths, torch.empty_like(out), offs)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms: every call below is queued before the first runs
            for src_buf, ptrs, lengths, offs, out, want in calls:
                pxn_kernels.gather(ptrs, lengths, out, offs)
            results.append(not stream.query())  # still busy: the calls did queue behind it
            stream.synchronize()
            for src_buf, ptrs, lengths, offs, out, want in calls:
                pxn_kernels.gather_torch(torch.from_numpy(ptrs).to(DEVICE), torch.from_numpy(lengths).to(DEVICE),
                                         want, torch.from_numpy(offs).to(DEVICE))
                torch.cuda.synchronize()
                results.append(torch.equal(out, want))

    seeds = rng.integers(0, 1 << 30, 3).tolist()
    alone = []
    run(seeds[0], alone)
    assert alone == [True] * 13
    both = [[], []]
    workers = [threading.Thread(target=run, args=(seed, got)) for seed, got in zip(seeds[1:], both)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert both == [[True] * 13, [True] * 13]


class FakeBackend:
    """``_staging.CudaBackend`` on the host: buffers are CPU tensors, the copy is a memmove made at once, and an
    event completes only when the test says so (``complete``)."""

    def __init__(self, capturing=False):
        self.pending = set()
        self.waited = []
        self.copies = []
        self.made = 0
        self.stream_made = 0
        self.capture = capturing
        self.fail_copy = False
        self._events = 0

    def buffers(self, words):
        self.made += 1
        return torch.empty(words, dtype=torch.int64), torch.empty(words, dtype=torch.int64)

    def stream_buffers(self, words):
        self.stream_made += 1
        return np.empty(words, dtype=np.int64), torch.empty(words, dtype=torch.int64)

    def event(self):
        self._events += 1
        return self._events

    def capturing(self, stream):
        return self.capture

    def copy(self, dst, src, nbytes, stream):
        if self.fail_copy:
            raise RuntimeError("index upload: cuMemcpyHtoDAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)")
        import ctypes
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((dst, nbytes, stream))

    def record(self, event, stream):
        self.pending.add(event)

    def done(self, event):
        return event not in self.pending

    def wait(self, event):
        self.waited.append(event)
        self.pending.discard(event)

    def complete(self, *slots):
        for slot in slots:
            self.pending.discard(slot.event)


def test_staging_pool_small_uploads_are_ordered_by_their_stream():
    """Uploads up to ``small_bytes`` take no slot and record no event: each thread has a buffer per stream, which
    only a later copy on that same stream rewrites (after the launches queued there before it); another stream or
    another thread gets a buffer of its own, a larger batch a larger buffer, a batch past ``small_bytes`` a slot,
    and under graph capture the pool still declines."""
    from pxn_kernels import _staging
    fake = FakeBackend()
    pool = _staging.UploadPool(fake, max_slots=2, small_bytes=16384)
    first = pool.upload([_np([1, 2, 3]), _np([4, 5, 6])], stream=5)
    assert first.slot is None and [v.tolist() for v in first.views] == [[1, 2, 3], [4, 5, 6]]
    pool.release(first)
    assert fake.pending == set() and fake.made == 0 and fake.stream_made == 1
    again = pool.upload([_np([7, 8, 9]), _np([10, 11, 12])], stream=5)
    assert [v.data_ptr() for v in again.views] == [v.data_ptr() for v in first.views]  # the same device buffer
    assert [v.tolist() for v in again.views] == [[7, 8, 9], [10, 11, 12]] and fake.stream_made == 1
    other_stream = pool.upload([_np([1, 2, 3])], stream=6)
    assert other_stream.views[0].data_ptr() != first.views[0].data_ptr() and fake.stream_made == 2
    seen = []
    worker = threading.Thread(target=lambda: seen.append(pool.upload([_np([4, 5, 6])], stream=5)))
    worker.start()
    worker.join()
    assert seen[0].slot is None and seen[0].views[0].data_ptr() != first.views[0].data_ptr()
    assert seen[0].views[0].tolist() == [4, 5, 6] and again.views[0].tolist() == [7, 8, 9]
    # 9600 bytes: still small, but past the first buffer's 1024 words: a new one
    grown = pool.upload([np.arange(600, dtype=np.int64), np.arange(600, dtype=np.int64) + 1], stream=5)
    assert grown.slot is None and grown.views[1].tolist() == list(range(1, 601)) and fake.stream_made == 4
    large = pool.upload([np.arange(1100, dtype=np.int64)] * 2, stream=5)  # 17600 bytes: a slot, an event
    assert large.slot is not None and large.views[0].tolist() == list(range(1100))
    pool.release(large)
    assert fake.pending == {large.slot.event}
    fake.capture = True
    assert pool.upload([_np([1])], stream=5) is None


def test_staging_pool_never_hands_out_a_slot_still_read():
    """A slot goes back to a caller only once the event recorded after its last launch completed: while it is
    pending the pool makes another slot, up to its cap, then waits for the oldest; an idle slot too small is
    grown, a pending one is not touched; under graph capture the pool declines; a failed copy returns the slot."""
    from pxn_kernels import _staging
    fake = FakeBackend()
    pool = _staging.UploadPool(fake, max_slots=3)
    a = [_np([1, 2, 3]), _np([4, 5, 6])]
    first = pool.upload(a, stream=11)
    assert [v.tolist() for v in first.views] == [[1, 2, 3], [4, 5, 6]]
    assert fake.copies == [(first.slot.dev_ptr, 48, 11)]
    pool.release(first)
    second = pool.upload([_np([7, 8, 9])], stream=12)
    assert second.slot is not first.slot  # the first is still pending: never rewritten
    assert [v.tolist() for v in first.views] == [[1, 2, 3], [4, 5, 6]]
    pool.release(second)
    fake.complete(first.slot)
    third = pool.upload([_np([10])], stream=11)
    assert third.slot is first.slot and third.views[0].tolist() == [10]  # the oldest, once done
    pool.release(third)
    # every slot pending and the cap reached: the oldest returned slot is waited for, then reused
    fourth = pool.upload([_np([1])], stream=1)
    assert fourth.slot not in (first.slot, second.slot)
    pool.release(fourth)
    assert fake.waited == []
    fifth = pool.upload([_np([2])], stream=1)
    assert fifth.slot is second.slot and fake.waited == [second.slot.event]
    pool.release(fifth)
    # growth: an idle slot too small gets new buffers; the views are of the new ones
    fake.complete(first.slot, second.slot, fourth.slot)
    big = np.arange(5000, dtype=np.int64)
    grown = pool.upload([big, big + 1], stream=2)
    assert grown.slot.words >= 10000 and grown.views[1][-1].item() == 5000
    pool.release(grown)
    # graph capture: no slot taken, nothing copied
    copies = len(fake.copies)
    fake.capture = True
    assert pool.upload(a, stream=3) is None
    fake.capture = False
    assert len(fake.copies) == copies
    # a failed copy: the error reaches the caller and the slot is returned (with its event), not lost
    fake.complete(*[s for s in pool._free])
    fake.fail_copy = True
    free_before = len(pool._free)
    with pytest.raises(RuntimeError, match="cuMemcpyHtoDAsync"):
        pool.upload(a, stream=4)
    assert len(pool._free) == free_before and not pool._lost


def test_staging_pool_threads_never_share_a_slot():
    """Threads uploading at once each get their own slot; a slot is handed out again only after its event."""
    import threading
    from pxn_kernels import _staging
    fake = FakeBackend()
    pool = _staging.UploadPool(fake, max_slots=64)
    held, errors = [], []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(k):
        try:
            barrier.wait()
            for i in range(200):
                up = pool.upload([np.full(3, k * 1000 + i, dtype=np.int64)], stream=k)
                with lock:
                    assert all(h.slot is not up.slot for h in held)
                    held.append(up)
                assert up.views[0].tolist() == [k * 1000 + i] * 3  # nobody else wrote into it
                with lock:
                    held.remove(up)
                pool.release(up)
                if i % 7 == 0:
                    fake.complete(*list(pool._free))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.skipif(HAS_CUDA, reason="the host-memory stand-in for the GPU pool runs the interpreted kernels")
@pytest.mark.parametrize("lengths", [[1, 63, 5, 64, 0, 17, 300], [63] * 11], ids=["range", "row"])
def test_staged_launch_through_the_pool_is_byte_exact(rng, lengths):
    """run_batch's upload path (host arrays -> pool slot -> the kernel reads the slot's device half) with the
    host-memory backend: byte-exact gather and scatter for the range and the row kernel (which gets no lengths
    uploaded); the slot is returned pending, and not reused while pending."""
    from pxn_kernels import _batched_copy, _staging
    fake = FakeBackend()
    pool = _staging.UploadPool(fake)
    n = len(lengths)
    src_buf, src = _distinct_pieces(rng, lengths, [1, 2, 0])
    offsets, size = packed_offsets(lengths, misalign=3, gap=1)
    out = random_bytes(rng, size + 8)
    ref = out.clone()
    cpu = torch.device("cpu")
    args = _checks.IndexArgs(n, True, {"src_ptrs": _np(src), "lengths": _np(lengths), "out_offsets": _np(offsets)})
    _batched_copy.run_batch("gather", args, "src_ptrs", "out_offsets", 0, out.data_ptr(), cpu, None, None, pool)
    pxn_kernels.gather_torch(i64(src), i64(lengths), ref, i64(offsets))
    assert torch.equal(out, ref)
    words = fake.copies[-1][1] // 8
    assert words == (2 * n if len(set(lengths)) == 1 else 3 * n)
    (slot,) = list(pool._free)
    assert fake.pending == {slot.event}
    back = random_bytes(rng, src_buf.numel())
    expect = back.clone()
    dst = [back.data_ptr() + a - src_buf.data_ptr() for a in src]
    args = _checks.IndexArgs(n, True, {"src_offsets": _np(offsets), "dst_ptrs": _np(dst), "lengths": _np(lengths)})
    _batched_copy.run_batch("scatter", args, "src_offsets", "dst_ptrs", out.data_ptr(), 0, cpu, None, None, pool)
    assert fake.copies[-1][0] != slot.dev_ptr  # the pending slot was not rewritten
    pxn_kernels.scatter_torch(ref, i64(offsets), i64([expect.data_ptr() + a - src_buf.data_ptr() for a in src]),
                              i64(lengths))
    assert torch.equal(back, expect)


@pytest.mark.gpu
def test_host_array_uploads_queued_behind_a_busy_gpu_stay_apart(rng):
    """Many gathers with host arrays queued behind a long kernel, on two streams: each must copy its own
    pieces. A staging buffer rewritten before the copy that read it ran would send a later call's descriptors
    to an earlier call's launch."""
    calls, length = 40, 192
    src_buf = random_bytes(rng, calls * 8 * length + 64)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    outs, expects = [], []
    torch.cuda.synchronize()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(50_000_000)  # keeps the current stream busy while the calls are queued
    streams[1].wait_stream(streams[0])
    for i in range(calls):
        n = 1 + i % 8
        picks = rng.choice(calls * 8, n, replace=False)
        lengths = [length - (i % 5)] * n if i % 2 else [int(x) for x in rng.integers(1, length, n)]
        src = [src_buf.data_ptr() + int(p) * length + (i % 3) for p in picks]
        offsets, size = packed_offsets(lengths, misalign=i % 4, gap=1)
        out = torch.zeros(size + 8, dtype=torch.uint8, device=DEVICE)
        with torch.cuda.stream(streams[i % 2]):
            pxn_kernels.gather(_np(src), _np(lengths), out, _np(offsets))
        expect = torch.zeros_like(out)
        pxn_kernels.gather_torch(i64(src), i64(lengths), expect, i64(offsets))
        outs.append(out)
        expects.append(expect)
    torch.cuda.synchronize()
    for out, expect in zip(outs, expects):
        assert torch.equal(out, expect)


@pytest.mark.gpu
def test_device_index_tensors_read_through_the_pinned_buffer(rng):
    """A checked call on device tensors, contiguous or strided (copied to contiguous first), byte-exact; a bad
    value, found by the summary kernel, is then read through the thread's pinned buffer and named."""
    lengths = [5, 64, 1, 300, 63]
    src_buf, src = _distinct_pieces(rng, lengths, [1, 0, 3])
    offsets, size = packed_offsets(lengths, misalign=1, gap=2)
    for strided in (False, True):
        out = random_bytes(rng, size + 8)
        ref = out.clone()
        s = i64(src)
        if strided:
            s = torch.stack([s, s], 1).reshape(-1)[::2]
            assert not s.is_contiguous()
        pxn_kernels.gather(s, i64(lengths), out, i64(offsets))
        pxn_kernels.gather_torch(i64(src), i64(lengths), ref, i64(offsets))
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
    bad = list(offsets)
    bad[3] = size + 100
    out = random_bytes(rng, size + 8)
    before = out.clone()
    with pytest.raises(ValueError, match=rf"out_offsets\[3\] = {size + 100} \+ lengths\[3\] = 300 runs past out"):
        pxn_kernels.gather(i64(src), i64(lengths), out, i64(bad))
    torch.cuda.synchronize()
    assert torch.equal(out, before)


def test_read_span_covers_only_tensors_whose_gaps_lie_in_their_pages():
    """``_staging.read_span``: one read over tensors whose every gap byte shares a 4 KiB page with a tensor byte
    (adjacent rows, 512 B allocator steps, overlaps, any order); None for a gap with a whole page in it or an
    address not 8 bytes from the lowest. A planted rule that allows a whole page of gap fails the 'far' cases."""
    from pxn_kernels._staging import read_span
    page = 4096
    base = 7 * (1 << 21)
    assert read_span([base, base + 128, base + 256], 128) == (base, 384)  # rows of one stacked tensor
    assert read_span([base + 1024, base, base + 512], 128) == (base, 1152)  # allocator steps, any order
    assert read_span([base, base, base + 64], 128) == (base, 192)  # the same tensor twice, overlaps
    assert read_span([base + page - 8, base + 2 * page - 8], 8) == (base + page - 8, page + 8)  # next page
    assert read_span([base, base + 2 * page], 8) is None  # the page base + 4096 holds no tensor byte
    assert read_span([base + page - 8, base + 2 * page + 8], 8) is None  # nor does base + 4096 here
    assert read_span([base, base + 8192 + 4], 8192) is None  # not a whole number of int64 from the lowest
    assert read_span([base, base + 8192], 8192) == (base, 16384)  # 8 KiB tensors back to back


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_device_index_tensors_read_in_one_copy_or_one_each_byte_exact(rng):
    """``_staging.read_to_host`` returns each tensor's values, byte-exact, whatever their layout: rows of one
    stacked tensor, separate allocations, the same tensor twice, and tensors far apart in one allocation (read one
    by one); the pinned buffer is poisoned before each read. Then a checked gather over such rows is byte-exact."""
    from pxn_kernels import _staging
    torch.cuda.set_device(0)
    for n in (1, 16, 1000, 4096):
        values = [torch.from_numpy(rng.integers(-(1 << 62), 1 << 62, n, dtype=np.int64)) for _ in range(3)]
        stacked = torch.stack(values).cuda()
        separate = [v.cuda() for v in values]
        wide = torch.empty(3 << 18, dtype=torch.int64, device="cuda")
        far = [wide[j << 18:(j << 18) + n] for j in range(3)]  # 2 MiB apart: one copy each
        for f, v in zip(far, values):
            f.copy_(v)
        assert _staging.read_span([t.data_ptr() for t in stacked], 8 * n) is not None  # the one-copy read
        assert _staging.read_span([t.data_ptr() for t in far], 8 * n) is None  # a copy each
        for layout in ([stacked[0], stacked[1], stacked[2]], [stacked[2], stacked[0], stacked[1]], separate,
                       [separate[1], separate[1], separate[0]], far):
            expect = [t.cpu().numpy() for t in layout]
            entry = getattr(_staging._tls, "read", {}).get(0)
            if entry is not None:
                entry[1][:] = -1  # poison the thread's pinned buffer
            got = _staging.read_to_host(layout, 0)
            for g, e in zip(got, expect):
                assert np.array_equal(g, e)
    pool = random_bytes(rng, 512 * 64)
    rows = torch.from_numpy(rng.permutation(512)[:40].astype(np.int64) * 64)
    idx = torch.stack([rows + pool.data_ptr(), torch.full((40,), 63), torch.arange(40) * 64]).cuda()
    out = random_bytes(rng, 40 * 64)
    ref = out.clone()
    pxn_kernels.gather(idx[0], idx[1], out, idx[2])
    pxn_kernels.gather_torch(idx[0].cpu(), idx[1].cpu(), ref, idx[2].cpu())
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
