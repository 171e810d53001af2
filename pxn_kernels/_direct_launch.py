"""Launch an already compiled Triton kernel with one ctypes call to ``cuLaunchKernel``.

Why: Triton's Python launch path re-derives every argument's specialisation, reads its knobs and prepares scratch
allocations on every call, which costs more host time per launch than the whole of a small ``copy_``. The relay
gathers small batches thousands of times per second, so the launch is the product's hot path. This launcher reads
the kernel's parameter list from its PTX once and afterwards only writes the argument values and calls the driver.

It declines (returns None, and the caller keeps Triton's own path) whenever the compiled kernel needs more
than plain parameters: scratch memory, clusters, cooperative or PDL launches.
"""
from __future__ import annotations

import ctypes
import logging
import re
import threading
from typing import Optional, Sequence

from pxn_kernels._libcuda import check, driver

log = logging.getLogger(__name__)

_PARAM = re.compile(r"\.param\s+\.(u64|b64|s64|u32|b32|s32)\b[^,)]*?(\w+)\s*[,)]")


class DirectLauncher:
    """Holds one compiled kernel's parameter buffer; ``launch(grid_x, stream, values)`` enqueues it."""

    def __init__(self, function: int, param_sizes: Sequence[int], n_user: int, num_warps: int, shared: int,
                 device: Optional[int] = None):
        self._device = device  # the GPU whose context holds the function (None: whatever is current)
        self._function = ctypes.c_void_p(function)
        self._values = [ctypes.c_int64(0) if size == 8 else ctypes.c_int32(0) for size in param_sizes]
        self._params = (ctypes.c_void_p * len(self._values))(*[ctypes.addressof(v) for v in self._values])
        self._user = self._values[:n_user]
        self._threads = 32 * num_warps
        self._shared = shared
        self._lock = threading.Lock()
        self._launch = driver().cuLaunchKernel

    @classmethod
    def create(cls, compiled, n_user: int, device: Optional[int] = None) -> Optional["DirectLauncher"]:
        meta = compiled.metadata
        reasons = []
        if getattr(meta, "num_ctas", 1) != 1:
            reasons.append("clusters")
        if getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
            reasons.append("cooperative/PDL launch")
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            reasons.append("scratch memory")
        if getattr(meta, "shared", 0) > 48 * 1024:
            reasons.append("large shared memory")
        ptx = compiled.asm.get("ptx", "")
        entry = ptx.find(".entry")
        params = [m.group(1) for m in _PARAM.finditer(ptx[entry:ptx.find(")", entry) + 1])] if entry >= 0 else []
        if len(params) < n_user:
            reasons.append(f"{len(params)} PTX parameters for {n_user} arguments")
        sizes = [8 if kind.endswith("64") else 4 for kind in params]
        if any(size != 8 for size in sizes[n_user:]):
            reasons.append("unexpected extra parameters")
        if reasons:
            log.info("direct launch declined for %s: %s", meta.name, ", ".join(reasons))
            return None
        compiled._init_handles()
        return cls(compiled.function, sizes, n_user, meta.num_warps, getattr(meta, "shared", 0), device)

    def launch(self, grid_x: int, stream: int, values: Sequence[int], grid_y: int = 1) -> None:
        if self._device is not None:
            import torch
            if torch._C._cuda_getDevice() != self._device:
                # the driver launches in the current context; the function belongs to its own GPU's context
                with torch.cuda.device(self._device):
                    return self.launch(grid_x, stream, values, grid_y)
        with self._lock:
            for slot, value in zip(self._user, values):
                slot.value = value
            err = self._launch(self._function, grid_x, grid_y, 1, self._threads, 1, 1, self._shared, stream,
                               self._params, None)
        if err:  # tested here: a call to ``check`` per launch would cost host time on the hot path
            check(err, "cuLaunchKernel")

    def bind(self, grid_x: int, grid_y: int, values: Sequence[int]):
        """A launch with fixed grid and argument values: ``fn(stream)`` is one driver call (no lock, no value
        writes; the relaunch path of callers that reuse their descriptors)."""
        return self._bound(grid_x, grid_y, values, None)

    def bind_current(self, grid_x: int, grid_y: int, values: Sequence[int], current_stream):
        """As ``bind``, but ``fn()`` takes no argument: it launches on ``current_stream()`` (a C callable such as
        ``functools.partial(torch._C._cuda_getCurrentRawStream, index)``), so that a relaunch is one Python
        frame around the driver call."""
        return self._bound(grid_x, grid_y, values, current_stream)

    def _bound(self, grid_x: int, grid_y: int, values: Sequence[int], current_stream):
        slots = [type(v)(0) for v in self._values]
        for slot, value in zip(slots, values):
            slot.value = value
        params = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(v) for v in slots])
        function, launch, threads, shared = self._function, self._launch, self._threads, self._shared
        device = self._device
        if device is not None:
            import torch
            current_device = torch._C._cuda_getDevice

        def enqueue_other(stream: int) -> None:  # the function lives in its GPU's context
            import torch
            with torch.cuda.device(device):
                err = launch(function, grid_x, grid_y, 1, threads, 1, 1, shared, stream, params, None)
            if err:
                check(err, "cuLaunchKernel")

        if current_stream is None:
            def enqueue(stream: int) -> None:
                if device is not None and current_device() != device:
                    return enqueue_other(stream)
                err = launch(function, grid_x, grid_y, 1, threads, 1, 1, shared, stream, params, None)
                if err:
                    check(err, "cuLaunchKernel")
        else:
            def enqueue() -> None:
                if device is not None and current_device() != device:
                    return enqueue_other(current_stream())
                err = launch(function, grid_x, grid_y, 1, threads, 1, 1, shared, current_stream(), params, None)
                if err:
                    check(err, "cuLaunchKernel")
        enqueue.keep = (slots, params)  # the driver reads the values through these pointers
        return enqueue
