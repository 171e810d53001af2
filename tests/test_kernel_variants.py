"""The range-kernel variants kept for benchmarks (benchmarks/kernel_variants.py: eager descriptor loads,
prefetch one or two ranges ahead, a register cap), byte-exact against the torch references like the library's
kernels, so that ``benchmarks/kernels.py --variants`` measures correct copies."""
import os
import sys

import pytest
import torch

import pxn_kernels
from kernel_helpers import DEVICE, VARIANT_LENGTHS, i64, packed_offsets, piece_sources, pool_with_rows, random_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import kernel_variants  # noqa: E402


@pytest.fixture
def rng(seed, request):
    import numpy as np
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _settings(lengths, mode):
    """VariantSettings for one mode over ``lengths`` (interpreter sizes: 64-byte tiles, 128-byte ranges)."""
    padded = sum((x + 15) // 16 * 16 for x in lengths)
    aligned = -(-padded // 128)
    s = kernel_variants.VariantSettings
    return {
        "aligned_np_eager": s(64, 16, 1, programs=aligned, range_bytes=128, persistent=False, eager=True),
        "aligned_np_extra_ranges": s(64, 16, 1, programs=aligned + 3, range_bytes=128, persistent=False,
                                     eager=True),  # trailing empty ranges
        "aligned_np_few_ranges": s(64, 16, 1, programs=max(1, aligned - 4), range_bytes=128, persistent=False,
                                   eager=True),  # the last range runs to the end of the stream
        "equal_np_eager": s(64, 16, 1, programs=7, persistent=False, eager=True),
        "eager_persistent": s(64, 16, 1, programs=2, rounds=4, eager=True, max_registers=32),
        "prefetch1_lazy": s(64, 16, 1, programs=3, rounds=-(-aligned // 3) + 1, range_bytes=128, prefetch=1),
        "prefetch1_eager": s(64, 16, 1, programs=3, rounds=-(-aligned // 3), range_bytes=128, prefetch=1,
                             eager=True),
        "prefetch2": s(64, 16, 1, programs=2, rounds=-(-aligned // 2) + 1, range_bytes=128, prefetch=2,
                       eager=True),
        "prefetch2_one_program": s(64, 16, 1, programs=1, rounds=5, prefetch=2, eager=True),
    }[mode]


MODES = ["aligned_np_eager", "aligned_np_extra_ranges", "aligned_np_few_ranges", "equal_np_eager",
         "eager_persistent", "prefetch1_lazy", "prefetch1_eager", "prefetch2", "prefetch2_one_program"]


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("mode", MODES)
def test_variant_gather_copy_scatter(rng, mode):
    lengths = list(VARIANT_LENGTHS)
    rng.shuffle(lengths)
    plan = pxn_kernels.plan_batched_copy(i64(lengths), _settings(lengths, mode))
    # gather: sources misaligned by 0/1/3/8, chunk offsets aligned except for a few pieces
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 1, 0, 3, 8])
    offsets, size = packed_offsets(lengths, misalign=0, gap=16)
    offsets = [o + (5 if i % 4 == 3 else 0) for i, o in enumerate(offsets)]
    out = random_bytes(rng, size + 64)
    ref = out.clone()
    kernel_variants.VariantCopy(i64(src_addrs), i64(offsets), i64(lengths), 0, out.data_ptr(), plan)()
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64(offsets))
    _sync()
    assert torch.equal(out, ref)
    for addr, length, offset in zip(src_addrs, lengths, offsets):
        start = addr - src_buf.data_ptr()
        assert torch.equal(ref[offset:offset + length], src_buf[start:start + length])
    # copy with fresh data, odd destination alignment
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 2])
    out = random_bytes(rng, sum(lengths) + 80 * len(lengths))
    ref = out.clone()
    dst_offsets, _ = packed_offsets(lengths, misalign=3, gap=13)
    kernel_variants.VariantCopy(i64(src_addrs), i64([out.data_ptr() + o for o in dst_offsets]), i64(lengths), 0, 0,
                                plan)()
    pxn_kernels.copy_torch(i64(src_addrs), i64([ref.data_ptr() + o for o in dst_offsets]), i64(lengths))
    _sync()
    assert torch.equal(out, ref)
    # scatter from a packed chunk
    chunk_offsets, chunk_size = packed_offsets(lengths, misalign=0, gap=16)
    chunk = random_bytes(rng, chunk_size)
    dst_offsets, dst_size = packed_offsets(lengths, misalign=16, gap=32)
    out = random_bytes(rng, dst_size + 64)
    ref = out.clone()
    kernel_variants.VariantCopy(i64(chunk_offsets), i64([out.data_ptr() + o for o in dst_offsets]), i64(lengths),
                                chunk.data_ptr(), 0, plan)()
    pxn_kernels.scatter_torch(chunk, i64(chunk_offsets), i64([ref.data_ptr() + o for o in dst_offsets]), i64(lengths))
    _sync()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode", ["aligned_np_eager", "prefetch2"])
def test_variant_zero_length_tail_and_empty_batch(rng, mode):
    lengths = [0, 0, 40, 1, 0, 0]
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 1])
    out = random_bytes(rng, 128)
    ref = out.clone()
    offsets = [0, 0, 16, 96, 100, 100]
    plan = pxn_kernels.plan_batched_copy(i64(lengths), _settings(lengths, mode))
    kernel_variants.VariantCopy(i64(src_addrs), i64(offsets), i64(lengths), 0, out.data_ptr(), plan)()
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64(offsets))
    zeros = [0, 0, 0]
    empty_plan = pxn_kernels.plan_batched_copy(i64(zeros), _settings(zeros, mode))
    kernel_variants.VariantCopy(i64(src_addrs[:3]), i64([0, 0, 0]), i64(zeros), 0, out.data_ptr(), empty_plan)()
    _sync()
    assert torch.equal(out, ref)


def test_variant_settings_follow_the_library_rule():
    regime = kernel_variants.VariantRegime(4096, 4, 8, range_bytes=4096, persistent=False, eager=True,
                                           max_registers=32)
    s = kernel_variants.variant_settings(regime, 4096, 8192 * 4096, 132)
    assert (s.programs, s.rounds, s.range_bytes, s.persistent, s.eager, s.max_registers) == \
        (8192 + 15, 1, 4096, False, True, 32)
    with pytest.raises(ValueError, match="2 needs eager"):
        kernel_variants.VariantSettings(256, 16, 1, 4, prefetch=2)


# --- the flat-mapped row kernel of benchmarks/row_sweep.py ------------------------------------------------------

import row_sweep  # noqa: E402


@pytest.mark.parametrize("length", [1, 3, 64, 100, 520])
@pytest.mark.parametrize("persistent", [False, True])
def test_flat_row_copy_gathers_and_scatters_rows_byte_exact(rng, length, persistent):
    """Rows picked at random from a pool (one misaligned by 1 byte, so its tile moves bytes) into a poisoned
    packed buffer and back into other rows of a second pool; byte-exact against the references."""
    n = 13
    pool, src = pool_with_rows(rng, length, n, 3 * n)
    src[5] += 1 if length > 1 else 0  # the pool has 16 spare bytes at its end
    out = random_bytes(rng, n * length + 16)
    ref = out.clone()
    offsets = i64([i * length for i in range(n)])
    copy = row_sweep.flat_row_copy(i64([a - pool.data_ptr() for a in src]), offsets, pool.data_ptr(),
                                   out.data_ptr(), length, 256 if length <= 256 else 1024, 1, persistent, 2)
    copy()
    pxn_kernels.gather_torch(i64(src), i64([length] * n), ref, offsets)
    back, dst = pool_with_rows(rng, length, n, 3 * n)
    expect = back.clone()
    row_sweep.flat_row_copy(offsets, i64([d - back.data_ptr() for d in dst]), out.data_ptr(), back.data_ptr(),
                            length, 512 if length <= 512 else 2048, 2, persistent, 3)()
    pxn_kernels.scatter_torch(ref, offsets, i64([d - back.data_ptr() + expect.data_ptr() for d in dst]),
                              i64([length] * n))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref) and torch.equal(back, expect)
    assert torch.equal(ref[:length], pool[src[0] - pool.data_ptr():src[0] - pool.data_ptr() + length])
    with pytest.raises(ValueError, match="length 2000 must be 1 .. block_bytes \\(1024\\)"):
        row_sweep.flat_row_copy(offsets, offsets, 0, 0, 2000, 1024, 1, persistent, 1)
