"""The launch policy: which kernel copies a batch and with which launch settings, per GPU architecture and size
class. The code picks from this table; users do not tune it.

Four kernels (see ``_batched_copy``, ``_grid_copy``, ``_row_copy``, ``_segment_copy``):

* pieces of one length below ``row.max_bytes``: the row kernel (several whole rows per program);
* pieces of (nearly) one length from ``grid.min_bytes`` up: the 2-D grid kernel (one segment of one piece per
  program);
* any other mix whose lengths the host knows, on a GPU: the segment kernel (one program per ``segment.seg_bytes``
  of one piece, from a table cached by the lengths);
* the rest (lengths only on the device, the CPU interpreter, ``segment.enabled`` false): the range kernel, with
  the ``range_small`` settings, or ``range_large`` when the mean piece is at least ``large_mean_bytes``.

``PXN_KERNEL_POLICY=file.json`` (read once, at the first launch) replaces entries of the table: a JSON object
with any of the keys below, either for every architecture or under an architecture's name (``"sm_90"``,
``"default"``); ``benchmarks/kernels.py --sweep`` writes such a file from its measurements. An unknown key or
a value of the wrong type raises ``ValueError`` naming it.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import threading
from typing import Optional

# Defaults from kernel sweeps on an H200 (benchmarks/kernels.py): small pieces want little
# device time per launch (4 KB tiles, 4 warps, 8 programs/SM), large pieces big tiles and many resident programs
# (32 KB, 8 warps, 32 programs/SM); equal pieces from 4 KB up a 4 KB program with 2 warps (grid kernel).
_BASE = {
    # shift: pieces whose ends differ in alignment move as 8-byte words assembled from two source words (on for
    # sm_90, where it was measured; elsewhere the byte path until a sweep there measures it).
    "range_small": {"block_bytes": 4096, "tail_block_bytes": 1024, "num_warps": 4, "programs_per_sm": 8,
                    "range_bytes": 0, "persistent": True, "streaming": False, "shift": False},
    "range_large": {"block_bytes": 32768, "tail_block_bytes": 1024, "num_warps": 8, "programs_per_sm": 32,
                    "range_bytes": 0, "persistent": True, "streaming": False, "shift": False},
    "large_mean_bytes": 512 << 10,  # mean piece (bytes) from which range_large applies
    "rounds_bytes": 32 << 10,  # equal split, bytes known: about this many bytes per range
    "max_rounds": 16,
    "max_programs": 1 << 16,
    "grid": {"enabled": True, "min_bytes": 4096, "seg_bytes": 4096, "block_bytes": 4096, "num_warps": 2,
             "shift": False},
    # Unequal pieces: one program per segment of at most seg_bytes of one piece, one warp, 4 KB per iteration.
    "segment": {"enabled": True, "seg_bytes": 16384, "block_bytes": 4096, "num_warps": 1, "shift": False},
    # Row kernel, by row length: the first class whose ``up_to`` (bytes) holds the length. tile_bytes: bytes per
    # program (whole rows, the row rounded up to a power of two, at most max_cols columns); split: a row that is
    # not a power of two goes as a head and a tail tile when that masks fewer lanes (RowSettings.tail);
    # programs_per_sm: 0 for a program per tile, else a persistent grid of that many programs per SM.
    "row": {"enabled": True, "max_bytes": 4095,
            "classes": [{"up_to": 256, "tile_bytes": 8192, "max_cols": 4096, "num_warps": 4, "split": False,
                         "programs_per_sm": 0},
                        {"up_to": 1 << 62, "tile_bytes": 8192, "max_cols": 4096, "num_warps": 4, "split": False,
                         "programs_per_sm": 0}]},
}

# Hopper (H100 / H200): the row classes that won the paged-row sweeps on an H200 (every candidate byte-checked
# first): one warp per program, persistent grids of 16 programs per SM up to 256 B rows and 32 above;
# 2 KB tiles up to 64 B rows, 1 KB up to 640 B (a 520 B or 576 B row alone in a 1 KB tile), 2 KB up to 1 KiB,
# 4 KB above. Shifted words for pieces whose two ends differ in alignment: they beat the byte path on every
# unaligned mix measured, and leave aligned pieces alone (benchmarks/results/kernels-h200-shift-quick.json).
_ONE_WARP = {"max_cols": 4096, "num_warps": 1, "split": False}
_SM90 = dict(_BASE, row={"enabled": True, "max_bytes": 4095,
                         "classes": [dict(_ONE_WARP, up_to=64, tile_bytes=2048, programs_per_sm=16),
                                     dict(_ONE_WARP, up_to=256, tile_bytes=1024, programs_per_sm=16),
                                     dict(_ONE_WARP, up_to=640, tile_bytes=1024, programs_per_sm=32),
                                     dict(_ONE_WARP, up_to=1024, tile_bytes=2048, programs_per_sm=32),
                                     dict(_ONE_WARP, up_to=1 << 62, tile_bytes=4096, programs_per_sm=32)]},
             range_small=dict(_BASE["range_small"], shift=True), range_large=dict(_BASE["range_large"], shift=True),
             grid=dict(_BASE["grid"], shift=True), segment=dict(_BASE["segment"], shift=True))

# Architectures (compute capability -> name) with their own entries; others use "default".
_TABLE = {"default": _BASE, "sm_90": _SM90}

# The built-in entry for the CPU (interpreter) runs and for callers that want the table without a device.
DEFAULT = _BASE

# The CPU interpreter: few, small programs (each is slow Python there).
INTERPRETER = {"block_bytes": 256, "tail_block_bytes": 16, "num_warps": 1, "max_programs": 16}

# Keys an entry of a list may leave out (a row class without "split" does not split; without "programs_per_sm"
# it launches a program per tile).
_OPTIONAL = {"split", "programs_per_sm"}

_LOCK = threading.Lock()
# Called after the overrides change (caches of plans built under the old policy).
on_change = []
_override: Optional[dict] = None
_loaded = False


def arch_name(device) -> str:
    """``"sm_<major><minor>"`` of a CUDA device (``"default"`` for anything else)."""
    if getattr(device, "type", None) != "cuda":
        return "default"
    major, minor = _capability(device.index if device.index is not None else 0)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    import torch
    return torch.cuda.get_device_capability(index)


def _check(path: str, value, reference) -> None:
    """``value`` has the shape of ``reference`` (same keys, same types; ints for ints, lists of objects)."""
    if isinstance(reference, dict):
        if not isinstance(value, dict):
            raise ValueError(f"kernel policy: {path} must be an object, got {value!r}")
        for key, item in value.items():
            if key not in reference:
                raise ValueError(f"kernel policy: unknown key {path}.{key} (known: {', '.join(reference)})")
            _check(f"{path}.{key}", item, reference[key])
    elif isinstance(reference, list):
        if not isinstance(value, list) or not value:
            raise ValueError(f"kernel policy: {path} must be a non-empty list, got {value!r}")
        for i, item in enumerate(value):
            _check(f"{path}[{i}]", item, reference[0])
            missing = set(reference[0]) - set(item) - _OPTIONAL
            if missing:
                raise ValueError(f"kernel policy: {path}[{i}] lacks {', '.join(sorted(missing))}")
    elif isinstance(reference, bool):
        if not isinstance(value, bool):
            raise ValueError(f"kernel policy: {path} must be true or false, got {value!r}")
    elif isinstance(reference, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"kernel policy: {path} must be a non-negative integer, got {value!r}")


def _merge(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse(text: str) -> dict:
    """A policy file's overrides, validated: ``{arch: overrides}`` (``"*"`` for every architecture)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"kernel policy: the file must hold a JSON object, got {type(data).__name__}")
    per_arch = {k: v for k, v in data.items() if k == "default" or k.startswith("sm_")}
    flat = {k: v for k, v in data.items() if k not in per_arch and not k.startswith("_")}  # "_note" etc.
    out = {}
    if flat:
        _check("policy", flat, _BASE)
        out["*"] = flat
    for arch, overrides in per_arch.items():
        _check(arch, overrides, _BASE)
        out[arch] = overrides
    return out


def _load_override() -> dict:
    global _override, _loaded
    if not _loaded:
        with _LOCK:
            if not _loaded:
                path = os.environ.get("PXN_KERNEL_POLICY")
                parsed = {}
                if path:
                    try:
                        with open(path) as f:
                            parsed = parse(f.read())
                    except OSError as exc:
                        raise ValueError(f"PXN_KERNEL_POLICY={path}: cannot read it ({exc})") from exc
                _override = parsed
                _loaded = True
    return _override or {}


@functools.lru_cache(maxsize=None)
def _resolved(arch: str) -> dict:
    base = _TABLE.get(arch, _TABLE["default"])
    override = _load_override()
    merged = _merge(base, override.get("*", {}))
    return _merge(merged, override.get(arch, {}))


def policy(device) -> dict:
    """The launch policy for ``device`` (a ``torch.device``): the table's entry for its architecture with the
    ``PXN_KERNEL_POLICY`` overrides applied. Read-only: callers must not change it."""
    return _resolved(arch_name(device))


def row_class(pol: dict, length: int) -> dict:
    """The row kernel's settings class for rows of ``length`` bytes."""
    for entry in pol["row"]["classes"]:
        if length <= entry["up_to"]:
            return entry
    return pol["row"]["classes"][-1]


def set_override(overrides: Optional[dict]) -> None:
    """Replace the ``PXN_KERNEL_POLICY`` overrides (``{arch or "*": {...}}``, validated) for this process; None
    reads the environment again at the next use. For benchmarks and tests."""
    global _override, _loaded
    with _LOCK:
        if overrides is not None:
            for arch, value in overrides.items():
                _check(arch, value, _BASE)
        _override = overrides
        _loaded = overrides is not None
    _resolved.cache_clear()
    for callback in on_change:
        callback()


def defaults(arch: str = "default") -> dict:
    """A copy of the built-in table entry for ``arch`` (without overrides)."""
    return copy.deepcopy(_TABLE.get(arch, _TABLE["default"]))
