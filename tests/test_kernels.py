"""gather / scatter / copy / pack_chunk against their torch references, byte for byte.

Without a GPU the Triton kernel runs under TRITON_INTERPRET=1 (see conftest), so cases stay small; the same
tests run at real sizes on a GPU (``gpu`` marker). Every test draws fresh random data (seed in the header),
poisons outputs with random bytes, and compares whole buffers, so stray and missing writes both show.
"""
import numpy as np
import pytest
import torch

import pxn_kernels
from pxn_kernels import chunk as chunk_mod
from transport.errors import ChunkFormatError

from kernel_helpers import (DEVICE, HAS_CUDA, VARIANT_LENGTHS, bad_call_leaves_out_untouched, i64, packed_offsets,
                            piece_sources, pool_with_rows, random_bytes)

# On the CPU, "triton" runs the real kernel in the interpreter; "auto" would pick the memmove path.
BACKENDS = ["triton", "host"] if not HAS_CUDA else ["triton"]


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _run_gather(rng, lengths, src_misalign=(0,), out_misalign=0, gap=0, backend="triton"):
    src_buf, src_addrs = piece_sources(rng, lengths, list(src_misalign))
    offsets, size = packed_offsets(lengths, out_misalign, gap)
    poison = random_bytes(rng, size + 32)
    out, ref = poison.clone(), poison.clone()
    pxn_kernels.gather(i64(src_addrs), i64(lengths), out, i64(offsets), backend=backend)
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64(offsets))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    # The reference itself must have moved the pieces (guards against a vacuous comparison).
    for addr, length, offset in zip(src_addrs, lengths, offsets):
        if length:
            start = addr - src_buf.data_ptr()
            assert torch.equal(ref[offset:offset + length], src_buf[start:start + length])
    return out


ODD_LENGTHS = [1, 3, 63, 65, 16, 0, 17, 200, 48, 15, 1, 129]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_misalign,out_misalign", [((0,), 0), ((1, 3, 5, 15), 0), ((0,), 7), ((1, 2), 9),
                                                       ((8,), 8)])
def test_gather_odd_lengths_and_alignments(rng, backend, src_misalign, out_misalign):
    _run_gather(rng, ODD_LENGTHS, src_misalign, out_misalign, gap=3, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_aligned_fast_path(rng, backend):
    lengths = [16, 32, 64, 4096, 1024, 48, 2048, 4112]
    _run_gather(rng, lengths, (0,), 0, gap=16, backend=backend)


def test_gather_zero_items():
    out = torch.full((16,), 7, dtype=torch.uint8, device=DEVICE)
    empty = i64([])
    pxn_kernels.gather(empty, empty, out, empty, backend="triton")
    assert torch.equal(out, torch.full_like(out, 7))


def test_gather_all_zero_lengths(rng):
    out = random_bytes(rng, 64)
    before = out.clone()
    pxn_kernels.gather(i64([out.data_ptr(), 0]), i64([0, 0]), out, i64([0, 5]), backend="triton")
    assert torch.equal(out, before)


def test_gather_one_huge_item(rng):
    # "Huge" relative to the launch: on the interpreter 48 KB spans every program; on a GPU 256 MB.
    size = (256 << 20) + 5 if HAS_CUDA else (48 << 10) + 5
    _run_gather(rng, [size], (0,), 0)


def test_gather_mixed_small_and_large(rng):
    lengths = [64, 8192, 1, 2 << 10, 100, 63, 16 << 10, 12] if not HAS_CUDA else \
        list(rng.integers(1, 8193, 300)) + [2 << 20] * 8
    rng.shuffle(lengths)
    _run_gather(rng, [int(x) for x in lengths], (0, 0, 4), 0, gap=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scatter_inverse_of_gather(rng, backend):
    lengths = ODD_LENGTHS
    offsets, size = packed_offsets(lengths, misalign=1, gap=2)
    src = random_bytes(rng, size)
    dst_poison = random_bytes(rng, size * 2 + 256)
    out, ref = dst_poison.clone(), dst_poison.clone()
    dst_offsets, _ = packed_offsets(lengths, misalign=5, gap=7)
    pxn_kernels.scatter(src, i64(offsets), i64([out.data_ptr() + o for o in dst_offsets]), i64(lengths),
                        backend=backend)
    pxn_kernels.scatter_torch(src, i64(offsets), i64([ref.data_ptr() + o for o in dst_offsets]), i64(lengths))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    for o, d, length in zip(offsets, dst_offsets, lengths):
        assert torch.equal(out[d:d + length], src[o:o + length])


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_batched(rng, backend):
    lengths = [1, 3, 63, 65, 4096, 0, 33, 160]
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 1, 2, 0])
    poison = random_bytes(rng, sum(lengths) + 64 * len(lengths))
    out, ref = poison.clone(), poison.clone()
    dst_offsets, _ = packed_offsets(lengths, misalign=3, gap=5)
    pxn_kernels.copy(i64(src_addrs), i64([out.data_ptr() + o for o in dst_offsets]), i64(lengths),
                     backend=backend)
    pxn_kernels.copy_torch(i64(src_addrs), i64([ref.data_ptr() + o for o in dst_offsets]), i64(lengths))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_kernel_runs_with_more_programs_than_bytes(rng):
    # Many programs whose byte range is empty must exit without touching anything.
    lengths = [1, 2]
    src_buf, src_addrs = piece_sources(rng, lengths, [0])
    out = random_bytes(rng, 32)
    ref = out.clone()
    plan = pxn_kernels.plan_batched_copy(
        i64(lengths), pxn_kernels.LaunchSettings(256, 16, 1, 9))
    pxn_kernels.gather(i64(src_addrs), i64(lengths), out, i64([0, 5]), plan=plan, backend="triton")
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64([0, 5]))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


# --- chunk packing and parsing -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_chunk_round_trip(rng, backend):
    lengths = [64, 64, 1, 512, 63, 8192, 17]
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 3])
    dst_addrs = [int(x) for x in rng.integers(1 << 20, 1 << 40, len(lengths))]
    slot = random_bytes(rng, chunk_mod.chunk_bytes_for(lengths) + 100)
    before = slot.clone()
    nbytes = pxn_kernels.pack_chunk(src_addrs, lengths, dst_addrs, slot, seq=42, sender_id=7,
                                    backend="host" if backend == "host" else "auto")
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    host = slot.cpu().numpy()
    table = chunk_mod.parse_chunk(host, available_bytes=nbytes)
    assert (table.seq, table.sender_id, table.item_count, table.chunk_bytes) == (42, 7, len(lengths), nbytes)
    assert table.dst_addrs.tolist() == dst_addrs
    assert table.lengths.tolist() == lengths
    for i, (addr, length) in enumerate(zip(src_addrs, lengths)):
        start = addr - src_buf.data_ptr()
        off = int(table.offsets[i])
        assert off % 16 == 0
        assert np.array_equal(host[off:off + length], src_buf[start:start + length].cpu().numpy())
    ref = before.clone()  # the whole slot against the reference: nothing written past the chunk either
    assert pxn_kernels.pack_chunk_torch(src_addrs, lengths, dst_addrs, ref, seq=42, sender_id=7) == nbytes
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    keep = torch.ones(slot.numel(), dtype=torch.bool, device=slot.device)
    for off, length in zip(table.offsets.tolist(), lengths):
        keep[off + length:off + (length + 15) // 16 * 16] = False  # padding between payloads: written by neither
    assert torch.equal(slot[keep], ref[keep])


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_chunk_zero_length_pieces_are_no_ops(rng, backend):
    """A piece of length 0 gets no table entry and no payload; the other pieces are packed as without it, and
    a batch of only zero-length pieces is a chunk of no items (header only)."""
    lengths = [0, 64, 0, 17, 0]
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 3])
    dst_addrs = [int(x) for x in rng.integers(1 << 20, 1 << 40, len(lengths))]
    kept = [i for i, n in enumerate(lengths) if n]
    slot = random_bytes(rng, 512)
    expect = chunk_mod.chunk_bytes_for([lengths[i] for i in kept])
    nbytes = pxn_kernels.pack_chunk(src_addrs, lengths, dst_addrs, slot, seq=3, sender_id=4,
                                    backend="host" if backend == "host" else "auto")
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert nbytes == expect
    host = slot.cpu().numpy()
    table = chunk_mod.parse_chunk(host, available_bytes=nbytes)
    assert table.lengths.tolist() == [lengths[i] for i in kept]
    assert table.dst_addrs.tolist() == [dst_addrs[i] for i in kept]
    for j, i in enumerate(kept):
        start, off = src_addrs[i] - src_buf.data_ptr(), int(table.offsets[j])
        assert np.array_equal(host[off:off + lengths[i]], src_buf[start:start + lengths[i]].cpu().numpy())
    before = random_bytes(rng, 512)
    slot.copy_(before)
    nbytes = pxn_kernels.pack_chunk(src_addrs[:1], [0], dst_addrs[:1], slot, seq=5, sender_id=4)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert nbytes == chunk_mod.payload_offset_for(0)
    assert chunk_mod.parse_chunk(slot.cpu().numpy(), available_bytes=nbytes).item_count == 0
    assert torch.equal(slot[nbytes:], before[nbytes:])  # nothing past the header


def _good_chunk(rng, n=3):
    lengths = [5, 64, 17][:n]
    header, _, nbytes = chunk_mod.build_header_table([0x1000, 0x2000, 0x3000][:n], lengths, seq=1, sender_id=2)
    buf = np.zeros(nbytes, dtype=np.uint8)
    buf[:header.size] = header
    return buf


def _recrc(buf):
    import struct
    import zlib
    n = struct.unpack_from("<I", buf, 16)[0]
    scratch = buf[:64 + 16 * n].copy()
    scratch[40:44] = 0
    buf[40:44] = np.frombuffer(struct.pack("<I", zlib.crc32(scratch)), dtype=np.uint8)


@pytest.mark.parametrize("field,offset,value,message", [
    ("magic", 0, b"XXXX", "bad magic"),
    ("version", 4, (9).to_bytes(2, "little"), "unsupported chunk version 9"),
    ("table_offset", 20, (32).to_bytes(4, "little"), "table_offset 32"),
    ("payload_offset", 24, (80).to_bytes(4, "little"), "payload_offset 80"),
    ("chunk_bytes", 28, (1 << 20).to_bytes(4, "little"), "chunk_bytes 1048576"),
    ("item_count", 16, (1000).to_bytes(4, "little"), "payload_offset"),
    ("length0", 64 + 8, (0).to_bytes(4, "little"), "item 0: length 0"),
    ("offset_misaligned", 64 + 12, (129).to_bytes(4, "little"), "not 16-byte aligned"),
    ("offset_into_table", 64 + 12, (16).to_bytes(4, "little"), "inside header/table"),
    ("offset_past_end", 64 + 16 + 12, (4096).to_bytes(4, "little"), "runs past chunk_bytes"),
    ("dst_overflow", 64, ((1 << 64) - 2).to_bytes(8, "little"), "overflows 64 bits"),
    ("overlap", 64 + 16 + 12, (112).to_bytes(4, "little"), "overlaps"),
])
def test_parse_chunk_rejects_each_malformed_field(rng, field, offset, value, message):
    buf = _good_chunk(rng)
    chunk_mod.parse_chunk(buf)  # the untouched chunk is valid
    assert chunk_mod.parse_chunk_rows(buf, buf.size) is not None
    buf[offset:offset + len(value)] = np.frombuffer(value, dtype=np.uint8)
    _recrc(buf)
    with pytest.raises(ChunkFormatError, match=message):
        chunk_mod.parse_chunk(buf)
    assert chunk_mod.parse_chunk_rows(buf, buf.size) is None  # the receiver's fast path refuses it too


def _rows_agree(buf, available):
    """``parse_chunk_rows`` accepts exactly the chunks ``parse_chunk`` accepts whose items are in payload order
    (1 to ROWS_MAX_ITEMS of them), with the same values; else it returns None."""
    try:
        t = chunk_mod.parse_chunk(buf, available_bytes=available)
    except ChunkFormatError:
        t = None
    rows = chunk_mod.parse_chunk_rows(buf, available)
    in_order = t is not None and 1 <= t.item_count <= chunk_mod.ROWS_MAX_ITEMS and \
        bool((t.offsets[1:] > t.offsets[:-1]).all())
    if not in_order:
        assert rows is None, (t, rows)
        return False
    seq, sender_id, chunk_bytes, dsts, lens, offs, lo, hi = rows
    assert (seq, sender_id, chunk_bytes) == (t.seq, t.sender_id, t.chunk_bytes)
    assert list(dsts) == t.dst_addrs.tolist() and list(lens) == t.lengths.tolist() and \
        list(offs) == t.offsets.tolist()
    assert (lo, hi) == (min(dsts), max(d + k for d, k in zip(dsts, lens)))
    return True


def test_parse_chunk_rows_agrees_with_parse_chunk(rng):
    """The receiver's fast parser against the full one on good chunks and on every kind of damage: one random
    field of the header or the table changed (checksum redone or not), the landed size short by a byte, items out
    of payload order, dst ranges at the top of the address space. Fails when any of parse_chunk's checks is
    missing from the fast path (it would accept what parse_chunk refuses)."""
    import struct
    accepted = refused = 0
    for trial in range(600):
        n = int(rng.integers(1, 40))
        lens = rng.integers(1, 5000, size=n)
        dsts = rng.integers(0, 1 << 48, size=n, dtype=np.int64).astype(np.uint64)
        header, _, nbytes = chunk_mod.build_header_table(dsts, lens, seq=trial, sender_id=77)
        buf = np.zeros(nbytes, dtype=np.uint8)
        buf[:header.size] = header
        kind = trial % 6
        if kind == 1:  # one table field: dst, length or offset, any value of its width
            i = int(rng.integers(0, n))
            field = int(rng.integers(0, 3))
            at, width = [(0, 8), (8, 4), (12, 4)][field]
            old = int.from_bytes(buf[64 + 16 * i + at:64 + 16 * i + at + width].tobytes(), "little")
            choices = [0, 1, 15, 16, 17, (1 << (8 * width)) - 1, int(rng.integers(0, 1 << 31))] + \
                [(old + d) % (1 << (8 * width)) for d in (-16, -1, 1, 16)] * 2  # near the good value
            value = choices[int(rng.integers(0, len(choices)))]
            if field == 0 and rng.random() < 0.5:
                value = (1 << 64) - int(rng.integers(1, 6000))  # near the top: the sum may overflow 64 bits
            buf[64 + 16 * i + at:64 + 16 * i + at + width] = np.frombuffer(value.to_bytes(width, "little"),
                                                                         dtype=np.uint8)
            _recrc(buf)
        elif kind == 2:  # one header field
            at, width = [(0, 4), (4, 2), (16, 4), (20, 4), (24, 4), (28, 4)][int(rng.integers(0, 6))]
            old = int.from_bytes(buf[at:at + width].tobytes(), "little")
            value = (old + int(rng.choice([-16, -1, 1, 16]))) % (1 << (8 * width))
            buf[at:at + width] = np.frombuffer(value.to_bytes(width, "little"), dtype=np.uint8)
            _recrc(buf)
        elif kind == 3:  # a byte changed, checksum not redone
            buf[int(rng.integers(0, 64 + 16 * n))] ^= 1 << int(rng.integers(0, 8))
        elif kind == 4 and n > 1:  # two items swap places in the table (payload order broken, no overlap)
            i, j = rng.choice(n, size=2, replace=False)
            a, b = buf[64 + 16 * i:80 + 16 * i].copy(), buf[64 + 16 * j:80 + 16 * j].copy()
            buf[64 + 16 * i:80 + 16 * i], buf[64 + 16 * j:80 + 16 * j] = b, a
            _recrc(buf)
        available = nbytes - (1 if kind == 5 else 0)
        if _rows_agree(buf, available):
            accepted += 1
        else:
            refused += 1
    assert accepted > 100 and refused > 100, (accepted, refused)
    # a table larger than the fast path reads, and an empty chunk: left to parse_chunk
    header, _, nbytes = chunk_mod.build_header_table(np.arange(chunk_mod.ROWS_MAX_ITEMS + 1, dtype=np.uint64) * 64,
                                                     np.full(chunk_mod.ROWS_MAX_ITEMS + 1, 64), seq=1, sender_id=2)
    assert chunk_mod.parse_chunk_rows(header, nbytes) is None
    header, _, nbytes = chunk_mod.build_header_table([], [], seq=1, sender_id=2)
    assert chunk_mod.parse_chunk_rows(header, nbytes) is None
    assert struct.unpack_from("<I", header, 16)[0] == 0


def test_parse_chunk_items_out_of_payload_order(rng):
    """Items whose payloads are not in table order: accepted when no two overlap, else the overlap is named (the
    in-order fast check does not decide for them)."""
    buf = _good_chunk(rng)
    off = [int.from_bytes(buf[64 + 16 * i + 12:64 + 16 * i + 16].tobytes(), "little") for i in range(3)]
    assert off == sorted(off)
    # swap the offsets of items 0 and 2 (lengths 5 and 17): every payload still fits, none overlaps
    buf[64 + 12:64 + 16] = np.frombuffer(off[2].to_bytes(4, "little"), dtype=np.uint8)
    buf[64 + 32 + 12:64 + 32 + 16] = np.frombuffer(off[0].to_bytes(4, "little"), dtype=np.uint8)
    buf[64 + 32 + 8:64 + 32 + 12] = np.frombuffer((5).to_bytes(4, "little"), dtype=np.uint8)
    buf[64 + 8:64 + 12] = np.frombuffer((17).to_bytes(4, "little"), dtype=np.uint8)
    _recrc(buf)
    t = chunk_mod.parse_chunk(buf)
    assert t.offsets.tolist() == [off[2], off[1], off[0]] and t.lengths.tolist() == [17, 64, 5]
    # item 0 now starts inside item 1's payload (out of order and overlapping)
    buf[64 + 12:64 + 16] = np.frombuffer((off[1] + 16).to_bytes(4, "little"), dtype=np.uint8)
    _recrc(buf)
    with pytest.raises(ChunkFormatError, match="overlaps the previous item"):
        chunk_mod.parse_chunk(buf)


def test_parse_chunk_checksum_and_truncation(rng):
    buf = _good_chunk(rng)
    buf[64 + 3] ^= 1  # table byte changed, checksum not recomputed
    with pytest.raises(ChunkFormatError, match="checksum mismatch"):
        chunk_mod.parse_chunk(buf)
    good = _good_chunk(rng)
    with pytest.raises(ChunkFormatError, match="shorter than its 64-byte header"):
        chunk_mod.parse_chunk(good[:40])
    with pytest.raises(ChunkFormatError, match="chunk_bytes"):
        chunk_mod.parse_chunk(good, available_bytes=good.size - 1)


# --- bad input: a clear ValueError naming the argument, and nothing written ---------------------------------

def test_gather_rejects_bad_input(rng):
    src = random_bytes(rng, 256)
    p = src.data_ptr()
    g = pxn_kernels.gather
    cases = [
        (lambda o: g(i64([p, p]), i64([4]), o, i64([0, 8])), "lengths has 1 items but src_ptrs has 2"),
        (lambda o: g(i64([p, p]), i64([4, -1]), o, i64([0, 8])), r"lengths\[1\] = -1 is negative"),
        (lambda o: g(i64([p, p]), i64([8, 8]), o, i64([0, 4])), r"out_offsets\[0\] = 0 \(length 8\) overlaps"),
        (lambda o: g(i64([p, p]), i64([8, 8]), o, i64([0, 250])), r"out_offsets\[1\] = 250 \+ lengths\[1\] = 8 "
                                                               r"runs past out \(256 bytes\)"),
        (lambda o: g(i64([p]), i64([8]), o, i64([-3])), r"out_offsets\[0\] = -3 is negative"),
        (lambda o: g(i64([0]), i64([8]), o, i64([0])), r"src_ptrs\[0\] = 0 is not a valid address"),
        (lambda o: g(i64([p]).to(torch.int32), i64([8]), o, i64([0])), "src_ptrs must be int64, got torch.int32"),
        (lambda o: g(i64([p]), i64([8]), o.to(torch.int16), i64([0])), "out must be uint8"),
        (lambda o: g(i64([p]).to("meta"), i64([8]), o, i64([0])), r"src_ptrs is on meta"),
        (lambda o: g([p], i64([8]), o, i64([0])), "src_ptrs must be an int64 torch.Tensor, got list"),
        (lambda o: g(i64([p]), i64([8]), o, i64([0]), backend="gpu"), "backend must be"),
    ]
    for call, match in cases:
        bad_call_leaves_out_untouched(rng, call, match)


def test_scatter_and_copy_reject_bad_input(rng):
    src = random_bytes(rng, 256)
    cases = [
        (lambda o: pxn_kernels.scatter(src, i64([0, 8]), i64([o.data_ptr(), o.data_ptr() + 4]), i64([8, 8])),
         r"dst_ptrs\[0\] = \d+ \(length 8\) overlaps"),
        (lambda o: pxn_kernels.scatter(src, i64([250]), i64([o.data_ptr()]), i64([8])),
         r"src_offsets\[0\] = 250 \+ lengths\[0\] = 8 runs past src"),
        (lambda o: pxn_kernels.copy(i64([src.data_ptr()]), i64([o.data_ptr()]), i64([-2])),
         r"lengths\[0\] = -2 is negative"),
        (lambda o: pxn_kernels.copy(i64([src.data_ptr()]), i64([(1 << 63) - 4]), i64([8])),
         r"dst_ptrs\[0\] = 0x7ffffffffffffffc \+ 8 overflows"),
    ]
    for call, match in cases:
        bad_call_leaves_out_untouched(rng, call, match)


def test_pack_chunk_rejects_bad_input(rng):
    slot = random_bytes(rng, 128)
    with pytest.raises(ValueError, match="must have the same number of items"):
        pxn_kernels.pack_chunk([1, 2], [4], [5, 6], slot, 0, 0)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -1 is negative"):
        pxn_kernels.pack_chunk([slot.data_ptr()] * 2, [4, -1], [5, 6], slot, 0, 0)
    with pytest.raises(ValueError, match="chunk needs 112 bytes, out has 100"):
        pxn_kernels.pack_chunk([slot.data_ptr()], [20], [5], slot[:100], 0, 0)


# --- GPU-only: other memory kinds --------------------------------------------------------------------------

@pytest.mark.gpu
def test_gather_from_pinned_host_memory(rng):
    lengths = [int(x) for x in rng.integers(1, 9000, 257)]
    host = torch.from_numpy(rng.integers(0, 256, sum(lengths) + 4096, dtype=np.uint8)).pin_memory()
    addrs, cursor = [], 0
    for length in lengths:
        cursor += int(rng.integers(0, 16))
        addrs.append(host.data_ptr() + cursor)
        cursor += length
    offsets, size = packed_offsets(lengths, 0, 16)
    out = random_bytes(rng, size)
    ref = out.clone()
    pxn_kernels.gather(i64(addrs), i64(lengths), out, i64(offsets))
    pxn_kernels.gather_torch(i64(addrs), i64(lengths), ref, i64(offsets))
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "range"])
@pytest.mark.parametrize("lengths", [[64] * 4096, [512] * 4096, [8192] * 4096, [65536] * 1024,
                                     [2359296] * 78, [8650752] * 78, "mixed", "mixed_odd"])
def test_gather_scatter_copy_at_benchmark_sizes(rng, lengths, kernel):
    """Checked calls pick their kernel from the host lengths (the grid kernel from 8 KB pieces up, the segment
    kernel for the benchmark's mixed mixes); "range" forces the range plan on the same sizes."""
    if lengths == "mixed":  # 1024 pieces of 64 B - 8 KB with 16 blocks of 2 MB among them
        lengths = [int(x) for x in rng.integers(64, 8193, 1024)]
        lengths[63::64] = [2 << 20] * 16
    elif lengths == "mixed_odd":
        lengths = [int(x) for x in rng.integers(1, 8193, 1024)]
        lengths[63::64] = [(2 << 20) + int(x) for x in rng.integers(0, 16, 16)]
    plan = pxn_kernels.plan_batched_copy(i64(lengths)) if kernel == "range" else None
    src_buf, src_addrs = piece_sources(rng, lengths, [0] if len(set(lengths)) == 1 else [0, 1, 5, 8, 15])
    offsets, size = packed_offsets(lengths)
    out = random_bytes(rng, size)
    ref = out.clone()
    pxn_kernels.gather(i64(src_addrs), i64(lengths), out, i64(offsets), plan=plan)
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64(offsets))
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    back = random_bytes(rng, src_buf.numel())
    expect = back.clone()
    dst = i64([back.data_ptr() + a - src_buf.data_ptr() for a in src_addrs])
    pxn_kernels.scatter(out, i64(offsets), dst, i64(lengths), plan=plan)
    pxn_kernels.scatter_torch(ref, i64(offsets), i64([expect.data_ptr() + a - src_buf.data_ptr()
                                                    for a in src_addrs]), i64(lengths))
    torch.cuda.synchronize()
    assert torch.equal(back, expect)
    expect_again = random_bytes(rng, src_buf.numel())
    again = expect_again.clone()
    pxn_kernels.copy(i64(src_addrs), i64([again.data_ptr() + a - src_buf.data_ptr() for a in src_addrs]),
                     i64(lengths), plan=plan)
    for a, length in zip(src_addrs, lengths):  # the expected image: poison outside the pieces
        s = a - src_buf.data_ptr()
        expect_again[s:s + length] = src_buf[s:s + length]
    torch.cuda.synchronize()
    assert torch.equal(again, expect_again)


def test_host_plan_matches_device_plan(rng):
    lengths = [int(x) for x in rng.integers(0, 5000, 37)] + [0, 1, 70000]
    for programs in (1, 7, 64, 300):
        settings = pxn_kernels.LaunchSettings(256, 16, 1, programs)
        device_plan = pxn_kernels.plan_batched_copy(i64(lengths), settings)
        pad_ends, bounds, first = pxn_kernels.plan_host(np.asarray(lengths, dtype=np.int64), programs)
        assert device_plan.pad_ends.cpu().tolist() == pad_ends.tolist()
        assert device_plan.bounds.cpu().tolist() == bounds.tolist()
        assert device_plan.first_item.cpu().tolist() == first.tolist()


def test_device_batch_copy(rng):
    lengths = np.asarray([5, 64, 0, 300, 17, 4096], dtype=np.int64)
    src_buf, src_addrs = piece_sources(rng, lengths.tolist(), [0, 1])
    out = random_bytes(rng, 8192)
    ref = out.clone()
    dst_offsets, _ = packed_offsets(lengths.tolist(), misalign=2, gap=1)
    dst = out.data_ptr() + np.asarray(dst_offsets, dtype=np.int64)
    batch = pxn_kernels.DeviceBatch(np.asarray(src_addrs, dtype=np.int64), dst, lengths, DEVICE,
                                    pxn_kernels.LaunchSettings(256, 16, 1, 5) if not HAS_CUDA else None)
    pxn_kernels.launch_batched_copy(batch.src, batch.dst, batch.lengths, 0, 0, batch.plan)
    pxn_kernels.copy_torch(i64(src_addrs), i64(ref.data_ptr() + np.asarray(dst_offsets)), i64(lengths.tolist()))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("graph", [False, True] if HAS_CUDA else [False])
def test_prepared_copy_relaunches_with_rewritten_descriptors(rng, graph):
    # The relay rewrites a slot's descriptor buffers in place and relaunches: the second launch must copy
    # the new pieces, not replay the old ones.
    lengths = [5, 64, 300, 17]
    settings = pxn_kernels.LaunchSettings(256, 16, 1, 4) if not HAS_CUDA else \
        pxn_kernels.launch_settings(len(lengths), DEVICE)
    _check_prepared_gather_relaunch(rng, lengths, 1, 2, settings, graph)


def _check_prepared_gather_relaunch(rng, lengths, misalign, gap, settings, graph=False):
    """A PreparedCopy gather relaunched after its source descriptors were rewritten in place (twice, each time
    to fresh random pieces) copies the new pieces, compared with the torch reference."""
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 3])
    out = random_bytes(rng, 1024)
    offsets, _ = packed_offsets(lengths, misalign=misalign, gap=gap)
    src_t, len_t, off_t = i64(src_addrs), i64(lengths), i64(offsets)
    plan = pxn_kernels.plan_batched_copy(len_t, settings)
    launch = pxn_kernels.PreparedCopy(src_t, off_t, len_t, 0, out.data_ptr(), plan, graph=graph)
    for _ in range(2):
        fresh = random_bytes(rng, src_buf.numel())
        src_t.copy_(i64([fresh.data_ptr() + a - src_buf.data_ptr() for a in src_addrs]))
        ref = out.clone()
        pxn_kernels.gather_torch(src_t, len_t, ref, off_t)
        launch()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(out, ref)


# --- range-kernel options: aligned ranges, one range per program, shifted words for unaligned pieces ---------

def _mode_settings(lengths, mode):
    """LaunchSettings for one range-kernel mode over ``lengths`` (interpreter sizes)."""
    padded = sum((x + 15) // 16 * 16 for x in lengths)
    aligned = -(-padded // 128)  # ranges of exactly 128 B
    s = pxn_kernels.LaunchSettings
    return {
        "aligned_persistent": s(64, 16, 1, programs=3, rounds=-(-aligned // 3), range_bytes=128),
        "aligned_np": s(64, 16, 1, programs=aligned, range_bytes=128, persistent=False),
        "aligned_np_extra_ranges": s(64, 16, 1, programs=aligned + 3, range_bytes=128, persistent=False),
        "aligned_np_few_ranges": s(64, 16, 1, programs=max(1, aligned - 4), range_bytes=128, persistent=False),
        "equal_np": s(64, 16, 1, programs=7, persistent=False),
        "equal_persistent_shift": s(64, 16, 1, programs=2, rounds=4, shift=True),
        "aligned_np_shift": s(64, 16, 1, programs=aligned, range_bytes=128, persistent=False, shift=True),
        "equal_shift_wide_tail": s(128, 64, 1, programs=3, shift=True),
    }[mode]


_MODES = ["aligned_persistent", "aligned_np", "aligned_np_extra_ranges", "aligned_np_few_ranges", "equal_np",
          "equal_persistent_shift", "aligned_np_shift", "equal_shift_wide_tail"]


@pytest.mark.parametrize("mode", _MODES)
def test_kernel_modes_gather_and_copy(rng, mode):
    lengths = list(VARIANT_LENGTHS)
    rng.shuffle(lengths)
    settings = _mode_settings(lengths, mode)
    plan = pxn_kernels.plan_batched_copy(i64(lengths), settings)
    # gather: sources misaligned by 0/1/3/8, chunk offsets aligned except for a few pieces
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 1, 0, 3, 8])
    offsets, size = packed_offsets(lengths, misalign=0, gap=16)
    offsets = [o + (5 if i % 4 == 3 else 0) for i, o in enumerate(offsets)]
    poison = random_bytes(rng, size + 64)
    out, ref = poison.clone(), poison.clone()
    pxn_kernels.gather(i64(src_addrs), i64(lengths), out, i64(offsets), plan=plan, backend="triton")
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64(offsets))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    for addr, length, offset in zip(src_addrs, lengths, offsets):
        start = addr - src_buf.data_ptr()
        assert torch.equal(ref[offset:offset + length], src_buf[start:start + length])
    # copy with fresh data, odd destination alignment
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 2])
    poison = random_bytes(rng, sum(lengths) + 80 * len(lengths))
    out, ref = poison.clone(), poison.clone()
    dst_offsets, _ = packed_offsets(lengths, misalign=3, gap=13)
    pxn_kernels.copy(i64(src_addrs), i64([out.data_ptr() + o for o in dst_offsets]), i64(lengths), plan=plan,
                     backend="triton")
    pxn_kernels.copy_torch(i64(src_addrs), i64([ref.data_ptr() + o for o in dst_offsets]), i64(lengths))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode", ["aligned_np", "aligned_np_shift"])
def test_kernel_modes_scatter(rng, mode):
    lengths = list(VARIANT_LENGTHS)
    settings = _mode_settings(lengths, mode)
    offsets, size = packed_offsets(lengths, misalign=0, gap=16)
    src = random_bytes(rng, size)
    dst_offsets, dst_size = packed_offsets(lengths, misalign=7, gap=32)
    poison = random_bytes(rng, dst_size + 64)
    out, ref = poison.clone(), poison.clone()
    plan = pxn_kernels.plan_batched_copy(i64(lengths), settings)
    pxn_kernels.scatter(src, i64(offsets), i64([out.data_ptr() + o for o in dst_offsets]), i64(lengths), plan=plan,
                        backend="triton")
    pxn_kernels.scatter_torch(src, i64(offsets), i64([ref.data_ptr() + o for o in dst_offsets]), i64(lengths))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("mode", ["aligned_np", "aligned_persistent", "equal_persistent_shift"])
def test_kernel_modes_zero_length_tail_and_empty_batch(rng, mode):
    # Zero-length items at both ends, and a batch that is all zero lengths.
    lengths = [0, 0, 40, 1, 0, 0]
    settings = _mode_settings(lengths, mode)
    src_buf, src_addrs = piece_sources(rng, lengths, [0, 1])
    out = random_bytes(rng, 128)
    ref = out.clone()
    offsets = [0, 0, 16, 96, 100, 100]
    plan = pxn_kernels.plan_batched_copy(i64(lengths), settings)
    pxn_kernels.gather(i64(src_addrs), i64(lengths), out, i64(offsets), plan=plan, backend="triton")
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64(offsets))
    zeros = [0, 0, 0]
    empty_plan = pxn_kernels.plan_batched_copy(i64(zeros), settings)
    pxn_kernels.gather(i64(src_addrs[:3]), i64(zeros), out, i64([0, 0, 0]), plan=empty_plan, backend="triton")
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("length", [64, 65, 200, 1000, 4099])
def test_shifted_words_every_alignment_pair(rng, length):
    """The 8-byte funnel-shift path: every (source, destination) misalignment pair 0..15 x 0..15, lengths from
    one word past the 64-byte threshold to several tiles, each against the torch reference on poisoned
    bytes (the bytes around each piece must stay as they were)."""
    settings = pxn_kernels.LaunchSettings(256, 16, 1, 4, shift=True)
    pairs = [(s, d) for s in range(16) for d in range(16)]
    rng.shuffle(pairs)
    pairs = pairs[:24] if length > 1000 else pairs[:64]  # interpreter time
    lengths = [length] * len(pairs)
    src_buf, src_addrs = piece_sources(rng, lengths, [s for s, _ in pairs])
    dst_offsets, cursor = [], 0
    for _, d in pairs:
        cursor = (cursor + 32 + 15) // 16 * 16 + d
        dst_offsets.append(cursor)
        cursor += length
    out = random_bytes(rng, cursor + 64)
    ref = out.clone()
    plan = pxn_kernels.plan_batched_copy(i64(lengths), settings)
    pxn_kernels.copy(i64(src_addrs), i64([out.data_ptr() + o for o in dst_offsets]), i64(lengths), plan=plan,
                     backend="triton")
    pxn_kernels.copy_torch(i64(src_addrs), i64([ref.data_ptr() + o for o in dst_offsets]), i64(lengths))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("range_bytes", [16, 128, 4096])
def test_aligned_host_plan_matches_device_plan(rng, range_bytes):
    lengths = [int(x) for x in rng.integers(0, 5000, 37)] + [0, 1, 70000]
    padded = sum((x + 15) // 16 * 16 for x in lengths)
    exact = -(-padded // range_bytes)
    for ranges in (1, max(1, exact - 3), exact, exact + 5):
        settings = pxn_kernels.LaunchSettings(256, 16, 1, ranges, range_bytes=range_bytes, persistent=False)
        device_plan = pxn_kernels.plan_batched_copy(i64(lengths), settings)
        pad_ends, bounds, first = pxn_kernels.plan_host(np.asarray(lengths, dtype=np.int64), ranges, range_bytes)
        assert device_plan.pad_ends.cpu().tolist() == pad_ends.tolist()
        assert device_plan.bounds.cpu().tolist() == bounds.tolist()
        assert device_plan.first_item.cpu().tolist() == first.tolist()
        expect = [min(r * range_bytes, padded) for r in range(ranges)] + [padded]
        assert bounds.tolist() == expect


def test_device_batch_aligned_non_persistent(rng):
    lengths = np.asarray([5, 64, 0, 300, 17, 4096, 1], dtype=np.int64)
    src_buf, src_addrs = piece_sources(rng, lengths.tolist(), [0, 1])
    out = random_bytes(rng, 8192)
    ref = out.clone()
    dst_offsets, _ = packed_offsets(lengths.tolist(), misalign=0, gap=16)
    dst = out.data_ptr() + np.asarray(dst_offsets, dtype=np.int64)
    padded = int(((lengths + 15) // 16 * 16).sum())
    settings = pxn_kernels.LaunchSettings(256, 16, 1, -(-padded // 512), range_bytes=512, persistent=False)
    batch = pxn_kernels.DeviceBatch(np.asarray(src_addrs, dtype=np.int64), dst, lengths, DEVICE, settings)
    assert batch.plan.bounds.cpu().tolist()[:-1] == [512 * r for r in range(settings.ranges)]
    pxn_kernels.launch_batched_copy(batch.src, batch.dst, batch.lengths, 0, 0, batch.plan)
    pxn_kernels.copy_torch(i64(src_addrs), i64(ref.data_ptr() + np.asarray(dst_offsets)), i64(lengths.tolist()))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_prepared_copy_with_mode_settings(rng):
    lengths = [5, 64, 300, 17, 1]
    _check_prepared_gather_relaunch(rng, lengths, 0, 16, _mode_settings(lengths, "aligned_np_shift"))


def test_settings_for_defaults_and_aligned(monkeypatch):
    import pxn_kernels._batched_copy as bc
    sms = 132
    monkeypatch.setattr(bc, "_multiprocessors", lambda index: sms)
    monkeypatch.setattr(pxn_kernels.policy, "arch_name", lambda device: "sm_90")
    cuda = torch.device("cuda", 0)
    # The default regimes reproduce the pre-variant formula.
    for n, total in [(11, 9900), (4096, 64 * 4096), (4096, 8192 * 4096), (1024, 65536 * 1024),
                     (78, 2359296 * 78), (78, 8650752 * 78), (5, None)]:
        got = pxn_kernels.launch_settings(n, cuda, total)
        large = bool(total) and total // n >= 512 << 10
        block, warps, per_sm = (32768, 8, 32) if large else (4096, 4, 8)
        programs = max(1, min(max(n, per_sm * sms), 1 << 16))
        rounds = 1 if not total else max(1, min(total // (programs * (32 << 10)), 16))
        # sm_90 moves pieces whose ends differ in alignment as shifted 8-byte words
        assert got == pxn_kernels.LaunchSettings(block, 1024, warps, programs, False, rounds, shift=True)
    # Aligned, one range per program: enough ranges for the padded stream (upper bound total + 15 n).
    regime = pxn_kernels.Regime(4096, 4, 8, range_bytes=4096, persistent=False, shift=True)
    s = pxn_kernels.settings_for(regime, 4096, 8192 * 4096, sms)
    assert (s.programs, s.rounds, s.range_bytes, s.persistent, s.shift) == (8192 + 15, 1, 4096, False, True)
    # Aligned persistent: programs_per_sm x SMs programs, rounds to cover every range.
    s = pxn_kernels.settings_for(pxn_kernels.Regime(4096, 4, 16, range_bytes=16384), 78, 8650752 * 78, sms)
    assert s.persistent and s.programs == 16 * sms and s.ranges * 16384 >= 8650752 * 78
    # Small batches keep the equal split (latency, not bandwidth): aux-like and many tiny pieces.
    for n, total in [(11, 9900), (4096, 64 * 4096), (4096, 512 * 4096)]:
        s = pxn_kernels.settings_for(regime, n, total, sms)
        assert s.range_bytes == 0 and s.programs == max(n, 8 * sms) and s.rounds == 1 and not s.persistent
    # Bytes unknown: equal split.
    assert pxn_kernels.settings_for(regime, 100, None, sms).range_bytes == 0


def test_launch_settings_validation():
    with pytest.raises(ValueError, match="rounds == 1"):
        pxn_kernels.LaunchSettings(256, 16, 1, 4, rounds=2, persistent=False)
    with pytest.raises(ValueError, match="power of two >= 16, got 100"):
        pxn_kernels.LaunchSettings(100, 16, 1, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        pxn_kernels.LaunchSettings(256, 16, 1, 4, range_bytes=100)


# --- range plan (any mix) and 2-D grid (large pieces of one size) ------------------------------------------

def _gather_scatter_copy_exact(rng, plan, lengths, src_misalign, out_misalign, prepared=False):
    """gather, scatter and copy of ``lengths`` through ``plan`` against the torch references: pieces at the given
    misalignments, fresh random data, poisoned outputs compared whole; the copy through the public call, or
    through a ``PreparedCopy`` of the plan (``prepared``)."""
    src_buf, src_addrs = piece_sources(rng, lengths, list(src_misalign))
    offsets, size = packed_offsets(lengths, out_misalign, 5)
    out = random_bytes(rng, size + 32)
    ref = out.clone()
    pxn_kernels.gather(i64(src_addrs), i64(lengths), out, i64(offsets), plan=plan, backend="triton")
    pxn_kernels.gather_torch(i64(src_addrs), i64(lengths), ref, i64(offsets))
    back = random_bytes(rng, src_buf.numel())
    expect = back.clone()
    shift = back.data_ptr() - src_buf.data_ptr()
    pxn_kernels.scatter(out, i64(offsets), i64([a + shift for a in src_addrs]), i64(lengths), plan=plan,
                        backend="triton")
    pxn_kernels.scatter_torch(ref, i64(offsets), i64([a + expect.data_ptr() - src_buf.data_ptr() for a in src_addrs]),
                              i64(lengths))
    copied = random_bytes(rng, src_buf.numel())
    copied_ref = copied.clone()
    copy_dst = i64([a + copied.data_ptr() - src_buf.data_ptr() for a in src_addrs])
    if prepared:
        pxn_kernels.PreparedCopy(i64(src_addrs), copy_dst, i64(lengths), 0, 0, plan)()
    else:
        pxn_kernels.copy(i64(src_addrs), copy_dst, i64(lengths), plan=plan, backend="triton")
    pxn_kernels.copy_torch(i64(src_addrs), i64([a + copied_ref.data_ptr() - src_buf.data_ptr() for a in src_addrs]),
                           i64(lengths))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert torch.equal(back, expect)
    assert torch.equal(copied, copied_ref)
    i = max(range(len(lengths)), key=lambda k: lengths[k])  # the reference moved the longest piece
    start = src_addrs[i] - src_buf.data_ptr()
    assert torch.equal(ref[offsets[i]:offsets[i] + lengths[i]], src_buf[start:start + lengths[i]])


@pytest.mark.parametrize("kernel", ["grid", "range"])
@pytest.mark.parametrize("lengths,src_misalign,out_misalign", [
    ([5000] * 3, (0,), 0), ([4099] * 4, (1, 3), 7), ([4096] * 5, (8,), 8), ([9000, 8999, 9001], (0,), 16),
    ([20000] * 2, (0,), 0), ([70001], (3,), 1)])  # several 4 KB segments, a short last one
def test_grid_and_range_kernels_byte_exact(rng, kernel, lengths, src_misalign, out_misalign):
    """gather, scatter and copy through each kernel on pieces the grid kernel takes: odd sizes (one byte short
    of, or past, a segment), unaligned sources and outputs, fresh random data, poisoned outputs."""
    plan = (pxn_kernels.plan_for_lengths(np.asarray(lengths), DEVICE) if kernel == "grid"
            else pxn_kernels.plan_batched_copy(i64(lengths)))
    assert (plan.grid is not None) == (kernel == "grid")
    _gather_scatter_copy_exact(rng, plan, lengths, src_misalign, out_misalign)


def test_prepared_copy_through_the_grid_kernel(rng):
    lengths = [4100] * 3
    plan = pxn_kernels.plan_for_lengths(np.asarray(lengths), DEVICE)
    assert plan.grid is not None
    src_buf, src_addrs = piece_sources(rng, lengths, [0])
    dst = random_bytes(rng, src_buf.numel())
    dsts = i64([a + dst.data_ptr() - src_buf.data_ptr() for a in src_addrs])
    launch = pxn_kernels.PreparedCopy(i64(src_addrs), dsts, i64(lengths), 0, 0, plan)
    for _ in range(2):  # relaunch after the source changed: the launch reads the descriptors again
        src_buf.copy_(random_bytes(rng, src_buf.numel()))
        launch()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        for a, n in zip(src_addrs, lengths):
            s = a - src_buf.data_ptr()
            assert torch.equal(dst[s:s + n], src_buf[s:s + n])


def test_plan_for_lengths_picks_the_kernel():
    plan = lambda lengths: pxn_kernels.plan_for_lengths(np.asarray(lengths, dtype=np.int64), DEVICE)
    pick = lambda lengths: plan(lengths).kernel
    shift = pxn_kernels.policy.policy(DEVICE)["grid"]["shift"]  # per architecture (on for sm_90)
    assert plan([8192] * 10).grid == pxn_kernels.GridSettings(4096, 4096, 2, 8192, shift)
    assert plan([2359296] * 3).grid == pxn_kernels.GridSettings(4096, 4096, 2, 2359296, shift)
    assert pick([64] * 100) == "row"  # rows of one length: several whole rows per program
    row_class = next(c for c in pxn_kernels.policy.policy(DEVICE)["row"]["classes"] if 100 <= c["up_to"])  # per architecture
    assert plan([100] * 5).row == pxn_kernels.row_settings(100, row_class["tile_bytes"], row_class["max_cols"],
                                                           row_class["num_warps"], row_class.get("split", False),
                                                           row_class.get("programs_per_sm", 0))
    assert pick([4095] * 3) == "row" and pick([4096] * 3) == "grid"
    # unequal sizes (most of a grid would idle): the segment kernel on a GPU, the range kernel in the interpreter
    unequal = "segment" if DEVICE.type == "cuda" else "range"
    assert pick([64, 2 << 20]) == unequal
    assert pick([64, 64, 0]) == unequal
    assert pick([5000, 5000, 6000]) == unequal  # 12.5 % of the grid wasted, over the 10 % allowed
    assert pick([5000, 5000, 5400]) == "grid"
    assert pick([]) == "range"
    if DEVICE.type == "cuda":
        seg = pxn_kernels.policy.policy(DEVICE)["segment"]["seg_bytes"]
        got = plan([1, seg, seg + 1, 0])
        assert got.segments.cpu().tolist() == [0, 1 << 32, 2 << 32, (2 << 32) | 1]
    with pytest.raises(ValueError, match="seg_bytes 1000 must be a multiple of block_bytes 512"):
        pxn_kernels.GridCopy(i64([0]), i64([0]), i64([1]), 0, 0, 1, seg_bytes=1000, block_bytes=512)


# --- the row kernel: pieces of one length (rows of a paged pool picked at random) ------------------------------

ROW_LENGTHS = [1, 3, 16, 64, 100, 520, 576, 1500, 2048]


@pytest.mark.parametrize("length", ROW_LENGTHS)
@pytest.mark.parametrize("misalign", [0, 1, 4, 8])
def test_row_kernel_gather_scatter_copy_paged_rows(rng, length, misalign):
    """Checked calls on rows of one length take the row kernel; gather, scatter and copy are byte-exact against
    the torch references on poisoned outputs, rows picked at random from a pool at every alignment."""
    n = 37  # not a multiple of any tile's row count: the last tile is partly empty
    assert pxn_kernels.plan_for_lengths(np.full(n, length), DEVICE).kernel == "row"
    pool, src = pool_with_rows(rng, length, n, 3 * n, misalign)
    lengths = i64([length] * n)
    # gather into a packed chunk starting at an offset that differs from the sources' alignment
    out = random_bytes(rng, n * length + 64)
    ref = out.clone()
    offsets = i64([3 * (misalign % 2) + i * length for i in range(n)])
    pxn_kernels.gather(i64(src), lengths, out, offsets, backend="triton")
    pxn_kernels.gather_torch(i64(src), lengths, ref, offsets)
    # scatter the chunk back to other random rows of a second (poisoned) pool
    back_pool, dst = pool_with_rows(rng, length, n, 3 * n, misalign)
    expect = back_pool.clone()
    pxn_kernels.scatter(out, offsets, i64(dst), lengths, backend="triton")
    pxn_kernels.scatter_torch(ref, offsets, i64([d - back_pool.data_ptr() + expect.data_ptr() for d in dst]), lengths)
    # copy pool rows to pool rows
    copied = random_bytes(rng, back_pool.numel())
    copied_ref = copied.clone()
    shift, shift_ref = copied.data_ptr() - back_pool.data_ptr(), copied_ref.data_ptr() - back_pool.data_ptr()
    pxn_kernels.copy(i64(src), i64([d + shift for d in dst]), lengths, backend="triton")
    pxn_kernels.copy_torch(i64(src), i64([d + shift_ref for d in dst]), lengths)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert torch.equal(back_pool, expect)
    assert torch.equal(copied, copied_ref)
    # the reference moved the bytes (guards against a vacuous comparison)
    s = src[-1] - pool.data_ptr()
    o = int(offsets[-1])
    assert torch.equal(ref[o:o + length], pool[s:s + length])


@pytest.mark.parametrize("rows,cols,tail,misaligned_rows", [(4, 16, 0, ()), (2, 64, 0, (5,)), (8, 32, 0, (0, 9)),
                                                         (1, 128, 0, (3,)), (4, 128, 128, ()), (2, 128, 128, (4,)),
                                                         (1, 128, 128, (0, 12))])
def test_row_kernel_tiles_and_mixed_alignment(rng, rows, cols, tail, misaligned_rows):
    """Explicit tile shapes: rows longer than a tile (several column tiles, a partial last one), several rows per
    program, rows as a head and a tail tile, and one misaligned row in a tile of aligned ones (the whole tile
    takes a narrower vector)."""
    length, n = 200, 13
    pool, src = pool_with_rows(rng, length, n, 2 * n + 1, 0)
    src = [a + (1 if i in misaligned_rows else 0) for i, a in enumerate(src)]
    settings = pxn_kernels.RowSettings(length, rows, cols, 1, tail)
    plan = pxn_kernels.CopyPlan(None, None, None, None, row=settings)
    out = random_bytes(rng, n * 208 + 16)
    ref = out.clone()
    offsets = i64([i * 208 for i in range(n)])  # 16-byte aligned chunk offsets
    pxn_kernels.gather(i64(src), i64([length] * n), out, offsets, plan=plan, backend="triton")
    pxn_kernels.gather_torch(i64(src), i64([length] * n), ref, offsets)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_prepared_copy_through_the_row_kernel(rng):
    length, n = 96, 9
    pool, src = pool_with_rows(rng, length, n, 20)
    plan = pxn_kernels.plan_for_lengths(np.full(n, length), DEVICE)
    assert plan.kernel == "row" and plan.row.length == length
    out = random_bytes(rng, n * length)
    src_t, off_t, len_t = i64(src), i64([i * length for i in range(n)]), i64([length] * n)
    launch = pxn_kernels.PreparedCopy(src_t, off_t, len_t, 0, out.data_ptr(), plan)
    for _ in range(2):  # relaunch after the descriptors were rewritten in place
        pool, fresh = pool_with_rows(rng, length, n, 20)  # the new pool stays alive until the next round
        src_t.copy_(i64(fresh))
        ref = out.clone()
        pxn_kernels.gather_torch(src_t, len_t, ref, off_t)
        launch()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_row_settings_shape_and_validation():
    s = pxn_kernels.row_settings(100, 8192, 4096, 4)
    assert (s.cols, s.rows) == (128, 64) and s.grid(129) == (3, 1)
    s = pxn_kernels.row_settings(1500, 8192, 512, 4)
    assert (s.cols, s.rows) == (512, 16) and s.grid(16) == (1, 3)
    s = pxn_kernels.row_settings(1, 4096, 4096, 2)
    assert (s.cols, s.rows) == (16, 256)
    with pytest.raises(ValueError, match="rows must be a power of two, got 3"):
        pxn_kernels.RowSettings(64, 3, 64, 4)
    with pytest.raises(ValueError, match="cols must be >= 16, got 8"):
        pxn_kernels.RowSettings(64, 4, 8, 4)
    with pytest.raises(ValueError, match="length 0"):
        pxn_kernels.RowSettings(0, 4, 64, 4)
    # split rows: a power-of-two head and the smallest power-of-two tail that holds the rest
    s = pxn_kernels.row_settings(520, 4096, 4096, 1, split=True)
    assert (s.cols, s.tail, s.rows) == (512, 16, 4) and s.grid(9) == (3, 1)
    s = pxn_kernels.row_settings(576, 4096, 4096, 1, split=True)
    assert (s.cols, s.tail, s.rows) == (512, 64, 4)
    assert pxn_kernels.row_settings(100, 4096, 4096, 1, split=True).tail == 0  # 64 + 64 masks as many as 128
    assert pxn_kernels.row_settings(512, 4096, 4096, 1, split=True).tail == 0  # a power of two needs no tail
    assert pxn_kernels.row_settings(520, 4096, 256, 1, split=True).tail == 0  # column tiles instead
    with pytest.raises(ValueError, match="tail 16: .* cols \\(512\\) < length \\(600\\) <= cols \\+ tail"):
        pxn_kernels.RowSettings(600, 4, 512, 1, 16)
    with pytest.raises(ValueError, match="tail 24"):
        pxn_kernels.RowSettings(520, 4, 512, 1, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 64, 100, 128, 520, 576, 1500, 2048, 4095, 4096, 8192])
@pytest.mark.parametrize("misalign", [0, 3])
def test_row_kernel_at_pool_sizes(rng, length, misalign):
    """Rows picked at random from a 64 MiB pool, gather then scatter through the policy's plan (the row kernel
    below its max_bytes), public calls and a CUDA-graph PreparedCopy, against index_select / index_copy_."""
    pool_rows = (64 << 20) // length
    n = min(4099, pool_rows)
    pool = torch.randint(0, 256, (pool_rows * length + 16,), dtype=torch.uint8, device=DEVICE)
    rows = pool[misalign:misalign + pool_rows * length].view(pool_rows, length)
    idx = torch.randperm(pool_rows, device=DEVICE)[:n]
    src = pool.data_ptr() + misalign + idx * length
    lengths = torch.full((n,), length, dtype=torch.int64, device=DEVICE)
    offsets = torch.arange(n, dtype=torch.int64, device=DEVICE) * length
    out = torch.randint(0, 256, (n * length,), dtype=torch.uint8, device=DEVICE)
    pxn_kernels.gather(src, lengths, out, offsets)
    expect = rows[idx].reshape(-1)
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
    plan = pxn_kernels.plan_for_lengths(np.full(n, length), DEVICE)
    out2 = torch.randint(0, 256, (n * length,), dtype=torch.uint8, device=DEVICE)
    pxn_kernels.PreparedCopy(src, offsets, lengths, 0, out2.data_ptr(), plan, graph=True)()
    torch.cuda.synchronize()
    assert torch.equal(out2, expect)
    chunk = torch.randint(0, 256, (n * length,), dtype=torch.uint8, device=DEVICE)
    before = pool.clone()
    pxn_kernels.scatter(chunk, offsets, src, lengths)
    before[misalign:misalign + pool_rows * length].view(pool_rows, length).index_copy_(0, idx,
                                                                                       chunk.view(n, length))
    torch.cuda.synchronize()
    assert torch.equal(pool, before)


def _unchecked_gather_exact(src_t, len_t, out, off_t, plan):
    """An unchecked gather through ``plan`` into ``out`` (random bytes: its poison) leaves every byte of ``out``
    as ``gather_torch`` leaves a copy of it."""
    ref = out.clone()
    pxn_kernels.gather(src_t, len_t, out, off_t, check=False, plan=plan, backend="triton")
    pxn_kernels.gather_torch(src_t, len_t, ref, off_t)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


def _plan_of_kind(kind, lengths):
    """A plan for ``lengths`` that runs ``kind``'s kernel on any device: the range plan built on the device, the
    segment kernel over 64-byte segments, else what the policy picks (row, grid)."""
    if kind == "range":
        plan = pxn_kernels.plan_batched_copy(i64(lengths))
    elif kind == "segment":
        plan = _segment_plan(lengths, 64, 32)
    else:
        plan = pxn_kernels.plan_for_lengths(np.asarray(lengths, dtype=np.int64), DEVICE)
    assert plan.kernel == kind
    return plan


@pytest.mark.parametrize("kind", ["row", "grid", "range", "segment"])
def test_unchecked_calls_with_a_plan_follow_their_arguments(rng, kind):
    """The unchecked call with a plan remembers its last arguments and launch (``_batched_copy.relaunch``). Each
    call must still copy what its arguments say now: the same tensors with rewritten contents (the remembered
    launch), other tensor objects, another ``out``, descriptors whose address or count changed in place (a
    ``set_`` onto another buffer, a ``resize_``), host arrays (the full path), and the other two entries over
    the same plan. Odd lengths at unaligned places, distinct bytes per piece, poisoned outputs, byte-exact."""
    from pxn_kernels import _batched_copy
    length = {"row": 63, "grid": 4100}.get(kind)
    lengths = [length] * 7 if length else [1, 63, 300, 17, 5, 90, 2]
    n = len(lengths)
    plan = _plan_of_kind(kind, lengths)
    len_t = i64(lengths)
    offsets, size = packed_offsets(lengths, misalign=3, gap=5)
    off_t = i64(offsets)

    out_main = random_bytes(rng, size + 16)

    def gather_and_compare(src_t, out=out_main, lens=len_t, offs=off_t, times=1):
        for _ in range(times):
            out.copy_(random_bytes(rng, out.numel()))  # poisoned afresh, in place: the same out object each call
            _unchecked_gather_exact(src_t, lens, out, offs, plan)

    src_buf, src = piece_sources(rng, lengths, [1, 0, 7])
    src_t = i64(src)
    for _ in range(3):  # remembered from the first call (on a GPU from the second, once the launch is bound)
        src_buf.copy_(random_bytes(rng, src_buf.numel()))
        gather_and_compare(src_t)
    assert plan._recent is not None and plan._recent[0]() is src_t
    other_buf, other = piece_sources(rng, lengths, [5, 2])
    src_t.copy_(i64(other))  # the same tensor rewritten in place: the remembered launch reads it
    gather_and_compare(src_t)
    gather_and_compare(i64(src))  # another tensor object (elsewhere) holding the first addresses
    kept = random_bytes(rng, size + 32)
    gather_and_compare(src_t, out=kept)  # another out
    gather_and_compare(src_t, out=kept[16:])  # another out at another address
    moved = i64(src)
    src_t.set_(moved.untyped_storage(), 0, (n,), (1,))  # the same object onto another buffer
    gather_and_compare(src_t, times=2)  # on a GPU the second call binds and is remembered
    assert plan._recent[4] == moved.data_ptr()
    moved_out = random_bytes(rng, size + 16)
    out_main.set_(moved_out.untyped_storage(), 0, (size + 16,), (1,))  # the same out object, another address
    gather_and_compare(src_t)
    shorter = i64(src[:-1])
    short_lens, short_offs = i64(lengths[:-1]), i64(offsets[:-1])
    if kind in ("row", "grid"):  # the range and segment plans are for n pieces; these hold for any count
        gather_and_compare(shorter, lens=short_lens, offs=short_offs)
        short_lens.resize_(n - 2)  # the same objects, one piece fewer each, same addresses
        short_offs.resize_(n - 2)
        shorter.resize_(n - 2)
        gather_and_compare(shorter, lens=short_lens, offs=short_offs)  # piece n - 2 stays poisoned
    # host arrays with check=False: the full path (checked types, uploaded or viewed)
    out = random_bytes(rng, size + 16)
    ref = out.clone()
    pxn_kernels.gather(np.asarray(src, dtype=np.int64), np.asarray(lengths, dtype=np.int64), out,
                       np.asarray(offsets, dtype=np.int64), check=False, plan=plan, backend="triton")
    pxn_kernels.gather_torch(i64(src), len_t, ref, off_t)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    # scatter and copy over the same plan, each twice (the second remembered), then gather again
    chunk = random_bytes(rng, size + 16)
    for _ in range(2):
        back = random_bytes(rng, src_buf.numel())
        expect = back.clone()
        dst_t = i64([back.data_ptr() + a - src_buf.data_ptr() for a in src])
        pxn_kernels.scatter(chunk, off_t, dst_t, len_t, check=False, plan=plan, backend="triton")
        ref_t = i64([expect.data_ptr() + a - src_buf.data_ptr() for a in src])
        pxn_kernels.scatter_torch(chunk, off_t, ref_t, len_t)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(back, expect)
        copy_dst = random_bytes(rng, src_buf.numel())
        copy_ref = copy_dst.clone()
        cd_t = i64([copy_dst.data_ptr() + a - src_buf.data_ptr() for a in src])
        cr_t = i64([copy_ref.data_ptr() + a - src_buf.data_ptr() for a in src])
        pxn_kernels.copy(src_t, cd_t, len_t, check=False, plan=plan, backend="triton")
        pxn_kernels.copy_torch(src_t, cr_t, len_t)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(copy_dst, copy_ref)
    gather_and_compare(src_t, times=2)
    assert plan._recent[0]() is src_t and plan._recent[3]() is out_main
    if DEVICE.type == "cpu":  # the CPU's "auto" backend is the memmove path: never the remembered launch
        assert not _batched_copy._lean(None, src_t, src_t, len_t, "auto")


@pytest.mark.parametrize("kind", ["row", "grid", "range", "segment"])
def test_plan_reused_over_other_descriptors(rng, kind):
    """One plan, launched over two descriptor sets and then over the first set rewritten in place: each launch
    copies what its descriptors say now (GPU launches are bound once per descriptor addresses and plan)."""
    length = {"row": 100, "grid": 4100}.get(kind)
    lengths = [length] * 6 if length else [5, 64, 300, 17, 1, 90]
    plan = _plan_of_kind(kind, lengths)
    len_t = i64(lengths)
    offsets, size = packed_offsets(lengths, 0, 16)
    runs = []
    for _ in range(2):
        src_buf, src = piece_sources(rng, lengths, [0, 3])
        runs.append((src_buf, i64(src), i64(offsets)))
    for src_buf, src_t, off_t in runs + [runs[0]]:
        src_buf.copy_(random_bytes(rng, src_buf.numel()))  # fresh bytes at the same addresses
        _unchecked_gather_exact(src_t, len_t, random_bytes(rng, size + 16), off_t, plan)
    import pxn_kernels._batched_copy as bc
    src_buf, src_t, off_t = runs[1]
    out = random_bytes(rng, size + 16)
    ref = out.clone()
    bc._bind(src_t, off_t, len_t, 0, out.data_ptr(), plan)()  # the bound launch itself, on any device
    pxn_kernels.gather_torch(src_t, len_t, ref, off_t)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


# --- the segment kernel: unequal pieces, one program per segment of one piece ----------------------------------

def _segment_plan(lengths, seg_bytes, block_bytes, shift=True):
    from pxn_kernels._segment_copy import SegmentSettings, segment_table
    table = segment_table(np.asarray(lengths, dtype=np.int64), seg_bytes)
    return pxn_kernels.CopyPlan(None, None, None, None, segment=SegmentSettings(seg_bytes, block_bytes, 1, shift),
                                segments=torch.from_numpy(table).to(DEVICE))


def test_segment_table_and_limits(monkeypatch):
    from pxn_kernels import _segment_copy as sc
    table = sc.segment_table(np.asarray([1, 0, 64, 65, -5, 200], dtype=np.int64), 64)
    expect = [(0, 0), (2, 0), (3, 0), (3, 1), (5, 0), (5, 1), (5, 2), (5, 3)]
    assert table.tolist() == [(i << 32) | k for i, k in expect]
    assert sc.segment_table(np.zeros(0, dtype=np.int64), 64).size == 0
    monkeypatch.setattr(sc, "MAX_SEGMENTS", 7)
    assert sc.segment_table(np.asarray([1, 0, 64, 65, -5, 200], dtype=np.int64), 64) is None
    with pytest.raises(ValueError, match="seg_bytes 100 must be a multiple of block_bytes 64"):
        sc.SegmentSettings(100, 64, 1)
    with pytest.raises(ValueError, match="block_bytes must be a power of two >= 16, got 24"):
        sc.SegmentSettings(48, 24, 1)
    with pytest.raises(ValueError, match="num_warps must be a power of two, got 3"):
        sc.SegmentSettings(64, 64, 3)
    off = dict(pxn_kernels.policy.defaults(), segment=dict(pxn_kernels.policy.defaults()["segment"], enabled=False))
    assert sc.segment_settings(off) is None


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("lengths,src_misalign,out_misalign", [
    ([1, 63, 0, 64, 65, 200, 3, 17], (0,), 0), ([1, 63, 0, 64, 65, 200, 3, 17], (1, 3, 8, 15), 5),
    ([300, 1, 129, 48], (7,), 9), ([513, 2, 0, 0, 31], (0, 4), 16)])
def test_segment_kernel_byte_exact(rng, shift, lengths, src_misalign, out_misalign):
    """gather, scatter and copy through the segment kernel with 64-byte segments (a piece over several programs,
    a short last segment, empty pieces), unaligned sources and outputs, fresh random data, poisoned outputs."""
    plan = _segment_plan(lengths, 64, 32, shift)
    assert plan.kernel == "segment"
    _gather_scatter_copy_exact(rng, plan, lengths, src_misalign, out_misalign, prepared=True)


@pytest.mark.parametrize("rows,programs_per_sm,cols", [(1, 1, 256), (2, 3, 256), (4, 2, 256), (8, 1, 256),
                                                        (2, 3, 128), (1, 2, 64)])
def test_row_kernel_persistent_programs(rng, rows, programs_per_sm, cols):
    """A persistent grid: fewer programs than row tiles, each walking tiles and loading the next tile's rows
    ahead; from the misaligned row's tile on, the byte-wise loop; rows longer than a tile as column tiles. Every
    row lands once, rows past the last tile are not touched (13 rows, not a multiple of a tile)."""
    import pxn_kernels._row_copy as rc
    length, n = 200, 13
    pool, src = pool_with_rows(rng, length, n, 2 * n + 1, 0)
    src = [a + (1 if i == 6 else 0) for i, a in enumerate(src)]  # one misaligned row: that tile narrows
    settings = pxn_kernels.RowSettings(length, rows, cols, 1, 0, programs_per_sm)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if DEVICE.type == "cuda" else 1
    tiles = -(-n // rows)
    assert settings.grid(n, sms)[0] == min(tiles, programs_per_sm * sms)
    assert settings.grid(n) == (tiles, -(-length // cols))
    plan = pxn_kernels.CopyPlan(None, None, None, None, row=settings)
    out = random_bytes(rng, n * 208 + 16)
    ref = out.clone()
    offsets = i64([i * 208 for i in range(n)])
    pxn_kernels.gather(i64(src), i64([length] * n), out, offsets, plan=plan, backend="triton")
    pxn_kernels.gather_torch(i64(src), i64([length] * n), ref, offsets)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert rc._grid(settings, n, DEVICE)[0] == min(tiles, programs_per_sm * sms)
    with pytest.raises(ValueError, match="programs_per_sm must be >= 0, got -1"):
        pxn_kernels.RowSettings(length, rows, cols, 1, 0, -1)
