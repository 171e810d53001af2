"""The argument checks of gather / scatter / copy (fast whole-array path against the per-piece reference), the
launch policy (table, PXN_KERNEL_POLICY file, plan cache), host index arrays, and what a CPU caller without the
interpreter is told."""
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import pxn_kernels
from pxn_kernels import _checks, policy
from test_kernels import DEVICE, HAS_CUDA, _pieces, _random_bytes, _t

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


def _batch(rng, n, kind):
    """(lengths, addresses, offsets, limit) of a valid batch: "sorted" chunk offsets, "rows" unordered rows of
    one length, "mixed" unordered pieces of any length, some of them 0."""
    if kind == "rows":
        length = int(rng.integers(1, 300))
        lengths = np.full(n, length, dtype=np.int64)
        starts = rng.permutation(3 * n)[:n].astype(np.int64) * length
    else:
        lengths = rng.integers(0 if kind == "mixed" else 1, 500, n).astype(np.int64)
        gaps = rng.integers(0, 9, n).astype(np.int64)
        starts = np.cumsum(np.concatenate(([0], lengths[:-1] + gaps[:-1]))).astype(np.int64)
        if kind == "mixed":
            order = rng.permutation(n)
            lengths, starts = lengths[order], starts[order]
    limit = int((starts + lengths).max()) + int(rng.integers(0, 3))
    addresses = rng.integers(1, 1 << 46, n).astype(np.int64)
    return lengths, addresses, starts, limit


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
@given(n=st.sampled_from([1, 2, 5, 63, 64, 65, 300, 5000]), kind=st.sampled_from(["sorted", "rows", "mixed"]),
       how=st.sampled_from(HOWS), case_seed=st.integers(0, 1 << 30))
def test_fast_checks_agree_with_the_per_piece_checks(seed, n, kind, how, case_seed):
    """Python-int path (<= 64 pieces), numpy path, sorted and unordered written ranges, zero lengths: the
    fast checks reject exactly what the per-piece checks reject, with the same message (the first bad piece)."""
    rng = np.random.default_rng([seed, case_seed])
    lengths, addresses, starts, limit = _batch(rng, n, kind)
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
    pool = _random_bytes(rng, length * 3 * n + 64)
    slots = rng.permutation(3 * n)[:n]
    dst = pool.data_ptr() + slots.astype(np.int64) * length
    src_buf, src = _pieces(rng, [length] * n, [0])
    chunk = _random_bytes(rng, n * length)
    offsets = np.arange(n, dtype=np.int64) * length
    bad = dst.copy()
    bad[n // 2] = bad[n // 3] + 8
    before = pool.clone()

    def call(d):
        if op == "scatter":
            pxn_kernels.scatter(chunk, _t(offsets), _t(d), _t([length] * n), backend="triton")
        elif op == "copy":
            pxn_kernels.copy(_t(src), _t(d), _t([length] * n), backend="triton")
        else:  # gather writes its chunk: the clash is in out_offsets
            o = offsets.copy()
            o[n // 2] = o[n // 3] + 8
            pxn_kernels.gather(_t(src), _t([length] * n), pool, _t(o if d is bad else offsets), backend="triton")
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
    src_buf, src = _pieces(rng, lengths, [0, 3])
    out = _random_bytes(rng, 512)
    ref = out.clone()
    offsets = [0, 16, 100, 200]
    as_np = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    pxn_kernels.gather(as_np(src), as_np(lengths), out, as_np(offsets), backend="triton")
    pxn_kernels.gather_torch(_t(src), _t(lengths), ref, _t(offsets))
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
        src_buf, src = _pieces(rng, lengths, [0, 3])
        offsets = np.cumsum([0] + [x + 16 for x in lengths[:-1]]).astype(np.int64)
        out = _random_bytes(rng, int(offsets[-1]) + lengths[-1] + 16)
        ref = out.clone()
        pxn_kernels.gather(np.asarray(src, dtype=np.int64), torch.tensor(lengths), out, offsets)
        pxn_kernels.gather_torch(_t(src), _t(lengths), ref, _t(offsets.tolist()))
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
    assert got["row"]["classes"] == policy.defaults()["row"]["classes"]  # untouched entries kept
    monkeypatch.setattr(policy, "arch_name", lambda device: "sm_80")
    assert policy.policy(torch.device("cuda", 0))["row"]["max_bytes"] == policy.defaults()["row"]["max_bytes"]
    for bad, message in [({"rows": {}}, "unknown key policy.rows"),
                         ({"grid": {"num_warps": "4"}}, "grid.num_warps must be a non-negative integer"),
                         ({"sm_90": {"row": {"classes": [{"up_to": 64}]}}}, r"lacks max_cols, num_warps, tile_bytes"),
                         ({"range_small": {"shift": 1}}, "shift must be true or false"),
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
    if DEVICE.type == "cuda":
        assert pxn_kernels.plan_for_lengths(lengths, DEVICE).kernel == "range"
    policy.set_override(None)
    mixed = np.array([5, 64, 300, 17] * 10, dtype=np.int64)
    first = pxn_kernels.plan_for_lengths(mixed, DEVICE)
    assert pxn_kernels.plan_for_lengths(mixed.copy(), DEVICE) is first  # cached by the lengths themselves
    swapped = mixed.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same count and sum, other order: another plan
    other = pxn_kernels.plan_for_lengths(swapped, DEVICE)
    assert other is not first and other.pad_ends.cpu().tolist()[:2] == [64, 80]


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
    """From 4096 pieces, unordered written ranges are sorted on the GPU: an overlap is refused with the usual
    message and nothing written; the batch without it is scattered byte-exact."""
    n = 5000
    pool = _random_bytes(rng, length * 2 * n)
    slots = torch.randperm(2 * n, device=DEVICE)[:n]
    dst = pool.data_ptr() + slots * length
    chunk = _random_bytes(rng, n * length)
    offsets = torch.arange(n, dtype=torch.int64, device=DEVICE) * length
    lengths = torch.full((n,), length, dtype=torch.int64, device=DEVICE)
    bad = dst.clone()
    bad[4321] = bad[17] + length // 2
    before = pool.clone()
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

    monkeypatch.setattr(dl, "_driver", lambda: FakeDriver)
    launcher = dl.DirectLauncher(1234, [8, 8, 4, 8], n_user=3, num_warps=4, shared=0)
    launcher.launch(7, 99, [1 << 40, -5, 123], grid_y=3)
    enqueue = launcher.bind(11, 2, [1 << 41, 6, (1 << 31) - 1])
    launcher.launch(8, 98, [1, 2, 3])  # the shared buffer changes; the binding keeps its own values
    enqueue(97)
    assert calls == [(7, 3, 128, 0, 99, [1 << 40, -5, 123, 0]), (8, 1, 128, 0, 98, [1, 2, 3, 0]),
                     (11, 2, 128, 0, 97, [1 << 41, 6, (1 << 31) - 1, 0])]


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
    """The unchecked-call shortcut (GPU only) takes a call only when every argument is what the full path
    accepts; anything else, including every CPU call, goes the full way (which raises with the name)."""
    import sys
    lean = sys.modules["pxn_kernels.gather"]._lean
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    buf = torch.zeros(64, dtype=torch.uint8)
    assert not lean(buf, t(1), t(1), t(1), "auto")  # CPU: never
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
