"""GPUDirect RDMA for the verbs fabric: GPU memory registered by dma-buf, and the flush that makes the NIC's writes
into GPU memory visible to the GPU work that consumes them.

**Registration.** A GPU range is exported as a dma-buf (``cuMemGetHandleForAddressRange``, host-page aligned) and
registered with ``Mlx5DmaBufMR`` (pyverbs v55+), its iova set to the CUDA virtual address so that peers address GPU
and host regions alike. Where that fails, a plain ``MR`` on the device address is tried (it needs the
``nvidia_peermem`` kernel module). A range neither way takes raises ``FabricError`` naming the GPU, the range,
the NIC and what is missing (``gpu_rdma_support`` says the same ahead of time, for ``pxn topo``).

**Ordering, sender side.** A NIC reads GPU memory over PCIe, unordered with CUDA streams. Whoever posts a write
of GPU memory waits for the work that produced it first (the relay ring waits for its gather on the host before
it posts; the engine waits for the caller's stream before a direct write). Writes of GPU memory never go with
``IBV_SEND_INLINE``: that makes the CPU copy the payload, and the CPU cannot read device memory.

**Ordering, receiver side.** A completion says the NIC has written; it does not say GPU work launched next will
see the bytes (NVIDIA's GPUDirect RDMA documentation promises that only where
``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`` reaches the consumer's scope). ``GpuFlush.flush(device)``
makes every write this NIC completed into that GPU visible before the receiver reads a landed chunk:

* ``"cuda"``: ``cuFlushGPUDirectRDMAWrites(TARGET_CURRENT_CTX, TO_OWNER)`` on the GPU's primary context, where
  ``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`` has the host option;
* ``"read"``: as NCCL's ``ncclIbIflush``, a 1-byte RDMA READ, on a QP connected to itself, of a small pxn-owned
  buffer on that GPU, into host memory: PCIe does not let a read pass the writes posted before it on the same
  path, so when the READ completes the earlier writes have landed;
* ``"auto"`` (the default): ``"cuda"`` where the device offers it, else ``"read"``;
* ``"none"``: no flush, for platforms whose ``GPU_DIRECT_RDMA_WRITES_ORDERING`` covers the owner GPU.

The flush QP and its CQ belong to the flushing thread under ``GpuFlush``'s lock, and are destroyed under it.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import threading
import time
from typing import Dict, Optional, Tuple

from transport.errors import FabricError

log = logging.getLogger(__name__)

DMABUF_MODULE = "pyverbs.providers.mlx5.mlx5dv_dmabuf"
"""Where pyverbs keeps ``Mlx5DmaBufMR`` (rdma-core v55 and later)."""

FLUSH_MODES = ("auto", "cuda", "read", "none")
FLUSH_BUFFER_BYTES = 4096
FLUSH_TIMEOUT_S = 5.0


def _driver():
    from cuda.bindings import driver
    return driver


def _cu(res, what: str):
    err = res[0]
    if int(err) != 0:
        raise FabricError(f"{what}: {err!r}")
    return res[1] if len(res) == 2 else res[1:]


def _attribute(device: int, name: str) -> Optional[int]:
    """A CUDA device attribute, or None where the driver or the bindings do not know it."""
    try:
        drv = _driver()
        _cu(drv.cuInit(0), "cuInit")
        return int(_cu(drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), device), name))
    except Exception:  # noqa: BLE001 — no driver, no bindings, an older driver without the attribute
        return None


def _cuda_ordinal(pci: str) -> Optional[int]:
    """The CUDA device index of the GPU at PCI address ``pci`` (sysfs form), or None where no driver answers."""
    try:
        drv = _driver()
        _cu(drv.cuInit(0), "cuInit")
        return int(_cu(drv.cuDeviceGetByPCIBusId(pci.encode()), "cuDeviceGetByPCIBusId"))
    except Exception:  # noqa: BLE001 — no driver or bindings, or a GPU this process cannot see
        return None


def gpu_rdma_support(device: Optional[int] = None, pci: Optional[str] = None, sysfs_root: str = "/",
                     nic: str = "mlx5") -> Tuple[bool, str]:
    """(can this GPU's memory be registered for RDMA with NIC ``nic`` here, how or why not): dma-buf (driver
    support, pyverbs v55+ and an mlx5 NIC: pyverbs takes a dma-buf fd through ``Mlx5DmaBufMR`` only) or
    ``nvidia_peermem``. The GPU is CUDA index ``device`` or the one at PCI address ``pci``. Costs no
    registration; ``pxn topo`` prints it per GPU and NIC."""
    if device is None and pci is not None and sysfs_root in ("/", ""):
        device = _cuda_ordinal(pci)
    dmabuf = None if device is None else _attribute(device, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED")
    have_module = _module_exists("pyverbs") and _module_exists(DMABUF_MODULE)
    peermem = os.path.isdir(os.path.join(sysfs_root or "/", "sys/module/nvidia_peermem"))
    mlx5 = nic.startswith("mlx5")
    if dmabuf and have_module and mlx5:
        return True, "dma-buf"
    if peermem:
        return True, "nvidia_peermem"
    missing = []
    if dmabuf is None:
        missing.append("no CUDA driver here to ask for dma-buf support")
    elif not dmabuf:
        missing.append("the driver cannot export GPU memory as dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0: "
                       "needs NVIDIA's open kernel modules and Linux >= 5.12)")
    if not have_module:
        missing.append(f"pyverbs has no {DMABUF_MODULE} (rdma-core < v55, or no pyverbs)")
    if not mlx5:
        missing.append(f"{nic} is not an mlx5 NIC (pyverbs registers a dma-buf fd only through Mlx5DmaBufMR)")
    missing.append("nvidia_peermem is not loaded")
    return False, "; ".join(missing)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _primary_context(device: int):
    """cuda:``device``'s primary context current in this thread for the driver calls inside: a driver API call
    from a thread where no CUDA runtime call bound one fails with CUDA_ERROR_INVALID_CONTEXT."""
    drv = _driver()
    _cu(drv.cuInit(0), "cuInit")
    ctx = _cu(drv.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain({device})")
    try:
        _cu(drv.cuCtxPushCurrent(ctx), f"cuCtxPushCurrent (cuda:{device})")
        try:
            yield
        finally:
            drv.cuCtxPopCurrent()
    finally:
        drv.cuDevicePrimaryCtxRelease(device)


def register_gpu(v: dict, pd, addr: int, length: int, device: int, access: int, nic: str):
    """(pyverbs MR, dma-buf fd or None) for ``length`` bytes of GPU memory at ``addr`` on cuda:``device``."""
    fd = None
    try:
        dmabuf_mr = importlib.import_module(DMABUF_MODULE).Mlx5DmaBufMR
        drv = _driver()
        page = os.sysconf("SC_PAGESIZE")
        base = addr & ~(page - 1)
        end = (addr + length + page - 1) & ~(page - 1)
        with _primary_context(device):  # the calling thread (a control thread, say) may have none current
            fd = int(_cu(drv.cuMemGetHandleForAddressRange(
                base, end - base, drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
                f"cuMemGetHandleForAddressRange(0x{base:x}, {end - base}, DMA_BUF_FD)"))
        mr = dmabuf_mr(pd, offset=addr - base, length=length, iova=addr, fd=fd, access=access)
        return mr, fd
    except Exception as ex:  # noqa: BLE001 — no dma-buf module, no export, the NIC refused: try peer memory
        first_error = ex
        if fd is not None:
            os.close(fd)
    try:
        return v["MR"](pd, length, access, address=addr), None
    except Exception as ex:  # noqa: BLE001
        ok, why = gpu_rdma_support(device, nic=nic)
        raise FabricError(f"verbs: GPU memory 0x{addr:x}+{length} on cuda:{device} cannot be registered with "
                          f"{nic}: dma-buf failed ({first_error}); peer-memory MR failed ({ex})"
                          + ("" if ok else f"; missing: {why}")) from ex


class GpuFlush:
    """The receive side's flush of GPUDirect RDMA writes, per GPU (module docstring). ``fabric``: the verbs fabric
    whose NIC wrote (its context, PD, port and a host scratch MR); ``mode``: one of ``FLUSH_MODES``."""

    def __init__(self, fabric, mode: str = "auto"):
        if mode not in FLUSH_MODES:
            raise ValueError(f"verbs: gdr_flush must be one of {', '.join(FLUSH_MODES)}, got {mode!r}")
        self.fabric, self.mode = fabric, mode
        self._lock = threading.Lock()
        self._methods: Dict[int, str] = {}  # device -> "cuda" / "read" / "none"
        self._contexts: Dict[int, object] = {}  # device -> retained primary context (cuda)
        # device -> (tensor, pyverbs MR, dma-buf fd, address, rkey): the buffer the READ flush reads on that GPU
        self._buffers: Dict[int, tuple] = {}
        self._qp = self._cq = self._wr = None
        self._closed = False
        self.counts = {"cuda": 0, "read": 0, "none": 0}

    def method(self, device: int) -> str:
        """The way writes into cuda:``device`` are flushed here: ``"cuda"``, ``"read"`` or ``"none"``."""
        m = self._methods.get(device)
        if m is None:
            m = self.mode
            if m == "auto":
                opts = _attribute(device, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS") or 0
                m = "cuda" if opts & 1 else "read"  # CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST
            self._methods[device] = m
        return m

    def flush(self, device: int) -> str:
        """Make every write this NIC completed into cuda:``device`` memory visible to that GPU; returns the
        method used. Raises ``FabricError`` naming the GPU and NIC when the flush fails."""
        m = self.method(device)
        with self._lock:
            if self._closed:
                raise FabricError(f"verbs {self.fabric.device}: flush of cuda:{device} after close")
            if m == "cuda":
                self._flush_cuda(device)
            elif m == "read":
                self._flush_read(device)
            self.counts[m] += 1
        return m

    def _flush_cuda(self, device: int) -> None:
        drv = _driver()
        ctx = self._contexts.get(device)
        if ctx is None:
            _cu(drv.cuInit(0), "cuInit")
            ctx = self._contexts[device] = _cu(drv.cuDevicePrimaryCtxRetain(device),
                                               f"cuDevicePrimaryCtxRetain({device})")
        _cu(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            _cu(drv.cuFlushGPUDirectRDMAWrites(
                drv.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                drv.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER),
                f"cuFlushGPUDirectRDMAWrites (cuda:{device})")
        finally:
            drv.cuCtxPopCurrent()

    def _flush_read(self, device: int) -> None:
        fab = self.fabric
        v, e = fab.v, fab.e
        if self._qp is None:
            self._qp, self._cq = fab.loopback_qp(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ)
            scratch = fab.scratch_mr
            self._wr = v["SendWR"](wr_id=1, opcode=e.IBV_WR_RDMA_READ, num_sge=1,
                                   sg=[v["SGE"](scratch.buf, 1, scratch.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        entry = self._buffers.get(device)
        if entry is None:
            import torch
            tensor = torch.zeros(FLUSH_BUFFER_BYTES, dtype=torch.uint8, device=f"cuda:{device}")
            mr, fd = register_gpu(v, fab.pd, tensor.data_ptr(), FLUSH_BUFFER_BYTES, device,
                                  e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ, fab.device)
            entry = self._buffers[device] = (tensor, mr, fd, tensor.data_ptr(), mr.rkey)
        self._wr.set_wr_rdma(entry[4], entry[3])
        failure = None
        try:
            self._qp.post_send(self._wr)
            deadline = time.monotonic() + FLUSH_TIMEOUT_S
            while True:
                n, wcs = self._cq.poll(num_entries=1)
                if n:
                    if wcs[0].status != e.IBV_WC_SUCCESS:
                        failure = f"failed with WC status {wcs[0].status}"
                    break
                if time.monotonic() > deadline:
                    failure = f"did not complete within {FLUSH_TIMEOUT_S} s"
                    break
        except Exception as ex:  # noqa: BLE001 — PyverbsRDMAError from post_send or poll
            failure = f"failed: {ex}"
        if failure is not None:
            # the QP is in the error state (or holds a READ that may still complete): the next flush makes a new one
            for obj in (self._qp, self._cq):
                obj.close()
            self._qp = self._cq = None
            raise FabricError(f"verbs {fab.device}: GPUDirect flush READ of cuda:{device} {failure}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _tensor, mr, fd, _addr, _rkey in self._buffers.values():
                mr.close()
                if fd is not None:
                    os.close(fd)
            self._buffers.clear()
            for obj in (self._qp, self._cq):
                if obj is not None:
                    obj.close()
            self._qp = self._cq = self._wr = None
            if self._contexts:
                drv = _driver()
                for device in self._contexts:
                    drv.cuDevicePrimaryCtxRelease(device)
                self._contexts.clear()
