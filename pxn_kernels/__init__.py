"""pxn_kernels: Triton kernels that gather scattered pieces into relay chunks and scatter them back.

Public entries (each with a plain-torch reference beside it):

* ``gather(src_ptrs, lengths, out, out_offsets)`` / ``gather_torch``
* ``scatter(src, src_offsets, dst_ptrs, lengths)`` / ``scatter_torch``
* ``copy(src_ptrs, dst_ptrs, lengths)`` / ``copy_torch``: batched memcpy in one launch
* four kernels behind them: the range kernel (any mix, ``_batched_copy``), the row kernel (pieces of one
  length, ``_row_copy``), the 2-D grid kernel (large pieces of one size, ``_grid_copy``) and the segment kernel
  (unequal pieces, one program per segment of one piece, ``_segment_copy``); ``plan_for_lengths`` picks one from
  host lengths, as the launch policy (``policy``) says
* the summary kernel (``_device_checks``): a checked call's checks of device index tensors, run on their GPU
* ``pack_chunk(...)`` / ``pack_chunk_torch``: header + item table + payload of a relay chunk in one launch
* ``chunk``: the chunk wire format (``build_header_table``, ``parse_chunk``)
* ``host_copy``: many memmoves on the host (the CPU path)

All index arguments are int64 tensors on the device that runs the copy; addresses are raw integers
(UVA: device memory of this or a peer GPU, or pinned host memory). Lengths are bytes.
"""
# Names load on first use (PEP 562): the kernels import torch and Triton, which take seconds, and the torch-free
# parts (``errors``, ``chunk``, ``policy``) are imported by code that never launches a kernel (``pxn --version``,
# the tcp engine on a machine without a GPU).
_LAZY = {
    "_batched_copy": ("CopyPlan", "DeviceBatch", "LaunchSettings", "PreparedCopy", "launch_batched_copy",
                      "launch_settings", "plan_batched_copy", "plan_for_lengths", "plan_host", "Regime",
                      "settings_for"),
    "_grid_copy": ("GridCopy", "GridSettings", "grid_settings"),
    "_row_copy": ("RowCopy", "RowSettings", "row_settings"),
    "_segment_copy": ("SegmentCopy", "SegmentSettings", "segment_table"),
    "_memory": ("host_copy", "host_view", "raw_view"),
    "batch_copy": ("copy", "copy_torch"),
    "gather": ("gather", "gather_torch"),
    "pack": ("pack_chunk", "pack_chunk_torch"),
    "scatter": ("scatter", "scatter_torch"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}
_SUBMODULES = ("chunk", "policy")


def __getattr__(name):
    import importlib
    if name in _SUBMODULES:
        return importlib.import_module(f"pxn_kernels.{name}")
    if name not in _WHERE:
        raise AttributeError(f"module 'pxn_kernels' has no attribute {name!r}")
    # All at once, and bound over the submodules of the same name (``gather``, ``scatter``), as the eager
    # imports did: ``pxn_kernels.gather`` is the function.
    for module, names in _LAZY.items():
        loaded = importlib.import_module(f"pxn_kernels.{module}")
        globals().update({n: getattr(loaded, n) for n in names})
    return globals()[name]


def __dir__():
    return sorted(set(globals()) | set(_WHERE) | set(_SUBMODULES))


__all__ = ["gather", "gather_torch", "scatter", "scatter_torch", "copy", "copy_torch", "pack_chunk", "pack_chunk_torch",
           "chunk", "host_copy", "host_view", "raw_view", "plan_batched_copy", "plan_host", "launch_settings",
           "launch_batched_copy", "LaunchSettings", "CopyPlan", "DeviceBatch", "PreparedCopy", "Regime",
           "settings_for", "plan_for_lengths", "GridCopy", "GridSettings", "grid_settings", "RowCopy", "RowSettings",
           "row_settings", "SegmentCopy", "SegmentSettings", "segment_table", "policy"]
