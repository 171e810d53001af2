"""The summary kernel (``pxn_kernels._device_checks``): the checks of index tensors that live on the GPU.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors and is compared with its torch reference;
on a GPU the public calls with device tensors take it, byte-exact, and every bad batch is refused with the same
message as the host checks give, nothing written."""
import numpy as np
import pytest
import torch

import pxn_kernels
from pxn_kernels import _checks, _device_checks
from kernel_helpers import DEVICE, HAS_CUDA, random_bytes, valid_batch

INT64_MAX = (1 << 63) - 1


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _spoil(rng, lengths, a, b, limit_a, limit_b, how):
    """A copy of one batch with one fault planted: ``how`` names it (as ``test_kernel_checks.HOWS``)."""
    lengths, a, b = lengths.copy(), a.copy(), b.copy()
    live = np.flatnonzero(lengths)
    i = int(rng.choice(live))
    address = a if limit_b is not None else b
    offsets, bound = (b, limit_b) if limit_b is not None else (a, limit_a)
    if how == "negative_length":
        lengths[i] = -int(rng.integers(1, 5))
    elif how == "zero_address":
        address[i] = -int(rng.integers(0, 3))
    elif how == "overflow":
        address[i] = INT64_MAX - int(lengths[i]) + 1
    elif how == "negative_offset" and bound is not None:
        offsets[i] = -1
    elif how == "past_limit" and bound is not None:
        offsets[i] = bound - int(lengths[i]) + 1
    elif how == "overlap" and live.size > 1:
        j = int(rng.choice(live[live != i]))
        b[i] = b[j] + int(rng.integers(0, lengths[j]))
    return lengths, a, b


def _run_kernel(lengths, a, b, limit_a, limit_b):
    n = lengths.numel()
    out = torch.full((_device_checks.HEADER + n,), -7, dtype=torch.int64, device=lengths.device)
    out[0] = 0
    tiles, columns = _device_checks.grid(n)
    _device_checks._summary_kernel[(tiles, columns)](
        lengths, a, b, out, n, limit_a or 0, limit_b or 0, A_RANGE=limit_a is not None, B_RANGE=limit_b is not None,
        TILE=_device_checks.TILE, BLOCK=_device_checks.BLOCK, LENGTHS_AT=_device_checks.HEADER,
        num_warps=_device_checks.NUM_WARPS)
    return out.cpu()


SIZES = [1, 2, 63, 64, 65, 130] + ([1000, 4096] if HAS_CUDA else [])


@pytest.mark.parametrize("n", SIZES)
def test_summary_kernel_agrees_with_its_torch_reference(rng, n):
    """Every result word against ``summary_torch``, for both roles of the written argument (offsets or
    addresses), batches in order, unordered rows and mixes with pieces of 0 bytes, clean and with each fault
    planted; the lengths' copy byte-exact over a poisoned buffer. The overlap word is compared where no range
    breaks its rule (a wrapped end makes it meaningless, and the caller then checks on the host anyway)."""
    for kind in ("sorted", "rows", "sorted_rows", "mixed"):
        for how in ("none", "negative_length", "zero_address", "overflow", "negative_offset", "past_limit",
                    "overlap"):
            lengths, addresses, starts, limit = valid_batch(rng, n, kind)
            if not lengths.any():
                lengths[0] = 1
            for written_offsets in (True, False):
                if written_offsets:
                    a, b, la, lb = addresses, starts, None, limit
                else:
                    a, b, la, lb = starts, addresses, limit, None
                lens, a, b = _spoil(rng, lengths, a, b, la, lb, how)
                t = [torch.from_numpy(x).to(DEVICE) for x in (lens, a, b)]
                got = _run_kernel(*t, la, lb)
                ref = _device_checks.summary_torch(*[x.cpu() for x in t], la or 0, lb or 0, la is not None,
                                                   lb is not None)
                words = got[:10].tolist()
                where = f"n={n} kind={kind} how={how} written_offsets={written_offsets}"
                assert words[1:] == ref[1:], where
                if not (ref[6] or ref[9]):
                    assert words[0] == ref[0], where
                assert torch.equal(got[_device_checks.HEADER:], torch.from_numpy(lens)), where


def test_summary_reference_finds_what_the_host_checks_find(rng):
    """``summary_torch`` refuses exactly the batches ``_checks.validate`` refuses (the reference the kernel is
    held to is itself held to the host checks): a flag or negative length where the host check raises."""
    for n in (1, 2, 40, 300):
        for kind in ("sorted", "rows", "mixed"):
            for how in ("none", "negative_length", "zero_address", "overflow", "negative_offset", "past_limit",
                        "overlap"):
                lengths, addresses, starts, limit = valid_batch(rng, n, kind)
                lens, a, b = _spoil(rng, lengths, addresses, starts, None, limit, how)
                words = _device_checks.summary_torch(torch.from_numpy(lens), torch.from_numpy(a),
                                                     torch.from_numpy(b), 0, limit, False, True)
                refused = bool(words[0] or words[6] or words[9] or words[1] < 0)
                try:
                    _checks.validate("gather", lens, [_checks.address("src_ptrs", a),
                                                      _checks.within("out_offsets", b, limit, "out")],
                                     written=("out_offsets", b))
                    host_refused = False
                except ValueError:
                    host_refused = True
                assert refused == host_refused, f"n={n} kind={kind} how={how}"


def _case(rng, op, n, kind):
    """Buffers and host index arrays of one valid ``op`` call of ``n`` pieces laid out as ``kind`` (see
    ``kernel_helpers.valid_batch``): random bytes in the sources, poisoned destinations."""
    lengths, _, starts, limit = valid_batch(rng, n, kind)
    if not lengths.any():
        lengths[0] = 1
    misalign = rng.integers(0, 16, n)
    packed = np.cumsum(np.concatenate(([0], lengths[:-1] + misalign[:-1]))).astype(np.int64) + int(misalign[0])
    packed_size = int(packed[-1] + lengths[-1]) + 16
    other = random_bytes(rng, packed_size)  # the side whose pieces are packed (gather's sources, ...)
    laid = random_bytes(rng, limit + 16)  # the side laid out as ``starts`` (gather's chunk, ...)
    if op == "gather":
        arrays = {"src_ptrs": other.data_ptr() + packed, "lengths": lengths, "out_offsets": starts}
        target, limits = laid, ("src_ptrs", None, "out_offsets", limit + 16)
    elif op == "scatter":
        arrays = {"src_offsets": packed, "dst_ptrs": laid.data_ptr() + starts, "lengths": lengths}
        target, limits = laid, ("src_offsets", packed_size, "dst_ptrs", None)
    else:
        arrays = {"src_ptrs": other.data_ptr() + packed, "dst_ptrs": laid.data_ptr() + starts, "lengths": lengths}
        target, limits = laid, ("src_ptrs", None, "dst_ptrs", None)
    return arrays, other, target, limits


def _call(op, arrays, other, target, reference=False):
    on = {k: torch.from_numpy(np.ascontiguousarray(v)).to(DEVICE) for k, v in arrays.items()}
    if op == "gather":
        fn = pxn_kernels.gather_torch if reference else pxn_kernels.gather
        fn(on["src_ptrs"], on["lengths"], target, on["out_offsets"])
    elif op == "scatter":
        fn = pxn_kernels.scatter_torch if reference else pxn_kernels.scatter
        fn(other, on["src_offsets"], on["dst_ptrs"], on["lengths"])
    else:
        fn = pxn_kernels.copy_torch if reference else pxn_kernels.copy
        fn(on["src_ptrs"], on["dst_ptrs"], on["lengths"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["gather", "scatter", "copy"])
def test_checked_calls_on_device_tensors_are_checked_on_the_gpu(rng, op, monkeypatch):
    """Device tensors of 1 to 4096 pieces (odd lengths, 1 B pieces, unaligned addresses, unordered rows, pieces
    of 0 bytes): the call is checked by the summary kernel (no read of the tensors), and copies byte-exact
    against the torch reference. Then each fault planted: the call raises the message the host checks give for
    the same arrays, and the destination keeps its poison."""
    reads = []
    real_to_host = _checks.to_host
    monkeypatch.setattr(_checks, "to_host", lambda *t: reads.append(len(t)) or real_to_host(*t))
    summaries = []
    real_summarize = _device_checks.summarize
    monkeypatch.setattr(_device_checks, "summarize",
                        lambda *a, **k: summaries.append(1) or real_summarize(*a, **k))
    for n in (1, 2, 63, 64, 65, 1000, 4096):
        for kind in ("sorted", "rows", "mixed"):
            arrays, other, target, limits = _case(rng, op, n, kind)
            poison = target.clone()
            expect = target.clone()
            ref_arrays = dict(arrays)
            if op != "gather":  # the reference writes the same layout into ``expect``
                ref_arrays["dst_ptrs"] = arrays["dst_ptrs"] - target.data_ptr() + expect.data_ptr()
            _call(op, ref_arrays, other, expect, reference=True)
            _call(op, arrays, other, target)  # the first call may read: peer_access learns the buffers
            reads.clear()
            summaries.clear()
            target.copy_(poison)
            _call(op, arrays, other, target)
            torch.cuda.synchronize()
            assert summaries and not reads, f"n={n} kind={kind}: checked on the host ({reads})"
            assert torch.equal(target, expect), f"n={n} kind={kind}"
            a_name, limit_a, b_name, limit_b = limits
            for how in ("negative_length", "zero_address", "overflow", "negative_offset", "past_limit", "overlap"):
                lens, a, b = _spoil(rng, arrays["lengths"], arrays[a_name], arrays[b_name], limit_a, limit_b, how)
                bad = dict(arrays, lengths=lens, **{a_name: a, b_name: b})
                if all(np.array_equal(bad[k], arrays[k]) for k in arrays):
                    continue  # no such fault for this call (an offset rule on ``copy``)
                host = dict(bad)
                with pytest.raises(ValueError) as host_error:  # the host checks' message for these arrays
                    if op == "gather":
                        pxn_kernels.gather(host["src_ptrs"], host["lengths"], target, host["out_offsets"])
                    elif op == "scatter":
                        pxn_kernels.scatter(other, host["src_offsets"], host["dst_ptrs"], host["lengths"])
                    else:
                        pxn_kernels.copy(host["src_ptrs"], host["dst_ptrs"], host["lengths"], device=DEVICE)
                before = target.clone()
                with pytest.raises(ValueError) as device_error:
                    _call(op, bad, other, target)
                torch.cuda.synchronize()
                assert str(device_error.value) == str(host_error.value), f"n={n} kind={kind} how={how}"
                assert torch.equal(target, before), f"n={n} kind={kind} how={how}: written"
