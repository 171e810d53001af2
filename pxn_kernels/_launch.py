"""What every pxn kernel launch shares: the anchor pointer, the current stream, and a compile-once cache that
launches through ``DirectLauncher`` (one ``cuLaunchKernel``) instead of Triton's Python launch path.

Why a cache per argument specialisation: Triton compiles one binary per (constexprs, pointer alignment, integer
width / divisibility by 16 / equality to 1) of the arguments; the direct launcher must use the binary Triton
itself would pick, so the key mirrors that specialisation.
"""
from __future__ import annotations

import functools
import threading
from typing import Dict, Sequence, Tuple

import torch

from pxn_kernels._direct_launch import DirectLauncher

# False: every launch goes through Triton's own path (the benchmark's host-overhead probe compares the two).
USE_DIRECT = True

_ANCHORS: Dict[torch.device, torch.Tensor] = {}
_ANCHOR_LOCK = threading.Lock()


def anchor(device: torch.device) -> torch.Tensor:
    """A 16-byte aligned uint8 tensor per device whose pointer the kernels offset from.

    Why: an int->pointer cast loses the alignment facts the compiler needs for 16-byte vector accesses;
    ``anchor + int64 offset`` keeps them.
    """
    key = device  # torch.device hashes by (type, index), as its string did
    found = _ANCHORS.get(key)
    if found is None:
        with _ANCHOR_LOCK:
            found = _ANCHORS.setdefault(key, torch.zeros(16, dtype=torch.uint8, device=device))
    return found


@functools.lru_cache(maxsize=None)
def multiprocessors(device_index: int) -> int:
    """The SM count of CUDA device ``device_index`` (launch settings scale their program counts by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of ``device_index``."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _int_spec(value: int):
    # What Triton specialises integer arguments on (width, == 1, divisible by 16).
    return (-(1 << 31) <= value < (1 << 31), value == 1, value % 16 == 0)


class CompiledKernel:
    """One ``@triton.jit`` kernel whose arguments are tensors first, then Python ints.

    ``bind(args, grid, constexprs)`` returns a zero-argument callable that enqueues the launch on the current
    stream: the direct launcher on CUDA, Triton's own launch otherwise (CPU interpreter; an int argument equal
    to 1, which Triton turns into a constant and whose parameter the positional direct launcher cannot fill).
    """

    def __init__(self, fn, n_tensors: int):
        self.fn = fn
        self.n_tensors = n_tensors
        self._compiled = {}

    def _direct(self, args: Sequence, grid: Tuple[int, int], constexprs: dict, device: torch.device):
        ints = args[self.n_tensors:]
        if not USE_DIRECT or device.type != "cuda" or 1 in ints:
            return None
        key = (device.index, tuple(sorted(constexprs.items())),
               tuple(t.data_ptr() % 16 == 0 for t in args[:self.n_tensors]), tuple(_int_spec(v) for v in ints))
        launcher = self._compiled.get(key)
        if launcher is None:
            # compiled and loaded in the context of the GPU it will run on: a function loaded in another GPU's
            # context fails to launch there (CUDA_ERROR_INVALID_HANDLE, seen with data on GPU 1)
            with torch.cuda.device(device):
                compiled = self.fn.warmup(*args, grid=grid, **constexprs)
                launcher = self._compiled.setdefault(
                    key, DirectLauncher.create(compiled, n_user=len(args), device=device.index) or False)
        return launcher or None

    def bind(self, args: Sequence, grid: Tuple[int, int], constexprs: dict):
        """A callable enqueuing ``fn[grid](*args, **constexprs)`` (the tensors must stay alive)."""
        device = args[0].device
        launcher = self._direct(args, grid, constexprs, device)
        if launcher is None:
            fn = self.fn
            return lambda: fn[grid](*args, **constexprs)
        values = [t.data_ptr() for t in args[:self.n_tensors]] + list(args[self.n_tensors:])
        index = device.index if device.index is not None else 0
        return launcher.bind_current(grid[0], grid[1], values,
                                     functools.partial(torch._C._cuda_getCurrentRawStream, index))

    def launch(self, args: Sequence, grid: Tuple[int, int], constexprs: dict) -> None:
        """Enqueue one launch now."""
        device = args[0].device
        launcher = self._direct(args, grid, constexprs, device)
        if launcher is None:
            self.fn[grid](*args, **constexprs)
            return
        values = [t.data_ptr() for t in args[:self.n_tensors]] + list(args[self.n_tensors:])
        launcher.launch(grid[0], current_stream(device.index if device.index is not None else 0), values,
                        grid_y=grid[1])

