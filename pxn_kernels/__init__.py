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
from pxn_kernels import chunk, policy  # noqa: F401
from pxn_kernels._batched_copy import (  # noqa: F401
    CopyPlan, DeviceBatch, LaunchSettings, PreparedCopy, launch_batched_copy, launch_settings, plan_batched_copy,
    plan_for_lengths, plan_host, Regime, settings_for,
)
from pxn_kernels._grid_copy import GridCopy, GridSettings, grid_settings  # noqa: F401
from pxn_kernels._row_copy import RowCopy, RowSettings, row_settings  # noqa: F401
from pxn_kernels._segment_copy import SegmentCopy, SegmentSettings, segment_table  # noqa: F401
from pxn_kernels._memory import host_copy, host_view, raw_view  # noqa: F401
from pxn_kernels.batch_copy import copy, copy_torch  # noqa: F401
from pxn_kernels.gather import gather, gather_torch  # noqa: F401
from pxn_kernels.pack import pack_chunk, pack_chunk_torch  # noqa: F401
from pxn_kernels.scatter import scatter, scatter_torch  # noqa: F401

__all__ = ["gather", "gather_torch", "scatter", "scatter_torch", "copy", "copy_torch", "pack_chunk", "pack_chunk_torch",
           "chunk", "host_copy", "host_view", "raw_view", "plan_batched_copy", "plan_host", "launch_settings",
           "launch_batched_copy", "LaunchSettings", "CopyPlan", "DeviceBatch", "PreparedCopy", "Regime",
           "settings_for", "plan_for_lengths", "GridCopy", "GridSettings", "grid_settings", "RowCopy", "RowSettings",
           "row_settings", "SegmentCopy", "SegmentSettings", "segment_table", "policy"]
