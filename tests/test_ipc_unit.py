"""process_vm_write (the ipc fabric's host-memory copy) on this process itself."""
import ctypes, mmap, os
import numpy as np
import pytest
from transport.fabric.ipc import process_vm_write


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
