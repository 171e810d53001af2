"""Helpers shared by the kernel tests (``test_kernels``, ``test_kernel_checks``, ``test_kernel_variants``,
``test_device_checks``): the device the kernels run on, fresh random bytes there, pieces at chosen misalignments,
packed offsets, int64 tensors, and the batches the argument checks take."""
import numpy as np
import pytest
import torch

from suite_env import HAS_CUDA

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def random_bytes(rng, n, device=DEVICE):
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).to(device)


def piece_sources(rng, lengths, src_misalign, device=DEVICE):
    """One source buffer with each piece at a chosen misalignment; returns (buffer, addresses)."""
    starts, cursor = [], 0
    for i, length in enumerate(lengths):
        cursor += 64 + (src_misalign[i % len(src_misalign)] if src_misalign else 0)
        starts.append(cursor)
        cursor += length
    buf = random_bytes(rng, cursor + 64, device)
    base = buf.data_ptr()
    assert base % 16 == 0
    return buf, [base + s for s in starts]


def packed_offsets(lengths, misalign=0, gap=0):
    offsets, cursor = [], misalign
    for length in lengths:
        offsets.append(cursor)
        cursor += length + gap
    return offsets, cursor


def i64(values, device=DEVICE):
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def bad_call_leaves_out_untouched(rng, call, match):
    """``call(out)`` on 256 poisoned bytes raises a ValueError matching ``match`` and writes nothing to them."""
    out = random_bytes(rng, 256)
    before = out.clone()
    with pytest.raises(ValueError, match=match):
        call(out)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, before), match


def pool_with_rows(rng, length, n, pool_rows, misalign=0):
    """A pool of ``pool_rows`` rows of ``length`` bytes (fresh random bytes, starting ``misalign`` bytes past a
    16-byte boundary) and the addresses of ``n`` distinct rows picked at random, unsorted."""
    pool = random_bytes(rng, pool_rows * length + misalign + 16)
    picks = rng.choice(pool_rows, n, replace=False)
    return pool, [pool.data_ptr() + misalign + int(k) * length for k in picks]


def valid_batch(rng, n, kind):
    """(lengths, addresses, offsets, limit) of a valid batch: "sorted" chunk offsets, "rows" unordered rows of
    one length, "sorted_rows" rows of one length in ascending order with gaps (a gather of rows into a chunk),
    "mixed" unordered pieces of any length, some of them 0."""
    if kind == "rows":
        length = int(rng.integers(1, 300))
        lengths = np.full(n, length, dtype=np.int64)
        starts = rng.permutation(3 * n)[:n].astype(np.int64) * length
    elif kind == "sorted_rows":
        length = int(rng.integers(1, 300))
        lengths = np.full(n, length, dtype=np.int64)
        starts = np.cumsum(rng.integers(0, 3, n) + length).astype(np.int64) - length
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


# Interpreter-sized: 64-byte tiles, 128-byte aligned ranges, so ranges hold several tiles and pieces span ranges.
VARIANT_LENGTHS = [1, 3, 63, 65, 0, 700, 16, 333, 17, 48, 5, 0, 129, 64]
