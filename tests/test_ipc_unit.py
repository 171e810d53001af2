"""process_vm_write (the ipc fabric's host-memory copy) on this process itself."""
import ctypes, mmap, os
import numpy as np
import pytest
from transport.fabric.procmem import process_vm_write


def test_process_vm_write_resumes_after_a_partial_transfer_then_reports_the_fault():
    """The kernel stops a vectored write at the first unwritable byte and reports the bytes done: the rest of the
    batch is resumed from there (here: into a protected page, so the resumed call fails with EFAULT), and every
    byte before the fault is in place."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    del anchor  # a live export would keep the mmap from closing
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    src = np.frombuffer(os.urandom(4096), dtype=np.uint8).copy()
    local = [src.ctypes.data, src.ctypes.data + 1000]
    remote = [base + 10, base + page - 300]  # the second piece runs 200 B into the second page
    lengths = [500, 500]
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
    try:
        with pytest.raises(OSError) as info:
            process_vm_write(os.getpid(), local, remote, lengths)
        assert info.value.errno == 14  # EFAULT
        got = bytes(region[:page])
        assert got[10:510] == bytes(src[:500])
        assert got[page - 300:page] == bytes(src[1000:1300])
    finally:
        libc.mprotect(base + page, page, 3)
        region.close()


@pytest.mark.parametrize("as_lists", [False, True])
def test_process_vm_write_many_pieces_odd_sizes_byte_exact(as_lists):
    """More pieces than one syscall's iovec limit (1024), odd lengths and unaligned addresses, from int64 arrays
    (the engine's hot path, with the total passed) and from plain lists: every piece lands, nothing else moves."""
    rng = np.random.default_rng()
    n = 2500
    lengths = rng.integers(1, 200, size=n).astype(np.int64)
    lengths[:3] = (1, 63, 65)
    src = np.frombuffer(rng.bytes(int(lengths.sum()) + 4096), dtype=np.uint8).copy()
    dst = np.full(2 * src.size, 0xA5, dtype=np.uint8)  # poisoned
    src_off = np.concatenate([[1], 1 + np.cumsum(lengths)[:-1]]).astype(np.int64)  # unaligned
    gaps = rng.integers(0, 9, size=n)
    dst_off = (np.concatenate([[3], 3 + np.cumsum(lengths + gaps)[:-1]])).astype(np.int64)
    rng.shuffle(perm := np.arange(n))  # pieces in any order
    local, remote, lens = src.ctypes.data + src_off[perm], dst.ctypes.data + dst_off[perm], lengths[perm]
    if as_lists:
        process_vm_write(os.getpid(), local.tolist(), remote.tolist(), lens.tolist())
    else:
        process_vm_write(os.getpid(), local, remote, lens, int(lens.sum()))
    expect = np.full_like(dst, 0xA5)
    for s, d, ln in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist()):
        expect[d:d + ln] = src[s:s + ln]
    assert np.array_equal(dst, expect)
