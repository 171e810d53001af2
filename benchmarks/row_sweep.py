#!/usr/bin/env python3
"""Row-kernel settings sweep on paged rows, and the flat-mapped row kernel the library does not use.

Rows of one size picked at random from a 1 GiB pool (sglang's paged KV pools), gathered into and scattered out
of one packed buffer, as in ``benchmarks/kernels.py``'s paged-row section, but over explicit ``RowSettings``
(tile bytes, column cap, warps, split rows) launched bound (``RowCopy``: one driver call per launch), so a
setting's device time is what is compared, not the public call's host time. Baselines in the same run:
``index_select`` / ``index_copy_`` on the widest integer view of the rows, and one contiguous ``copy_``.

The flat-mapped variant (``flat:...``) lays a program's words out as one vector over ``R`` whole rows (word e
belongs to row e // W, W = words per row), so no lane is masked whatever the row length; it lost to the row
kernel at every size measured (benchmarks/NOTES.md, "Row kernel: one-warp programs and split rows") and is kept
here, byte-checked by ``tests/test_kernel_variants.py``, as the measured alternative.

Every candidate is checked byte-exact (gather into a poisoned buffer; scatter into a restored pool compared
whole) before it is timed; a candidate that fails is reported and not timed.

Usage: python3 benchmarks/row_sweep.py [--sizes 520,576,2048] [--out PATH]
       TRITON_INTERPRET=1 python3 benchmarks/row_sweep.py --smoke   (CPU dry run, tiny pool)
Writes JSON lines ``{row_bytes, op, method, gbps, ratio_torch, ratio_contiguous, exact}`` to PATH (default: a
temporary file; nothing under benchmarks/results/ unless --out says so).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels import timed  # noqa: E402  (benchmarks/kernels.py, beside this script)
from pxn_kernels._launch import CompiledKernel, anchor  # noqa: E402
from pxn_kernels._row_copy import RowCopy, row_settings  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (tile bytes, column cap, warps, split rows, persistent programs per SM: 0 = one program per tile)
ROW_VARIANTS = [(1024, 4096, 1, False, 0), (2048, 4096, 1, False, 0), (2048, 4096, 1, True, 0),
                (4096, 4096, 1, False, 0), (4096, 4096, 1, True, 0), (4096, 4096, 2, False, 0),
                (8192, 4096, 4, False, 0),
                (1024, 4096, 1, False, 32), (2048, 4096, 1, False, 16), (2048, 4096, 1, False, 32),
                (2048, 4096, 1, True, 32), (4096, 4096, 1, False, 32), (4096, 4096, 1, True, 32),
                (4096, 4096, 2, False, 16), (8192, 4096, 2, False, 16)]
# (bytes per program, warps, persistent)
FLAT_VARIANTS = [(2048, 2, False), (4096, 2, False), (4096, 4, False), (8192, 4, False), (4096, 2, True),
                 (8192, 4, True)]
SIZES = (64, 100, 128, 256, 520, 576, 1024, 1500, 2048, 4096)


@triton.jit
def _flat_words(anchor_ptr, src_index, dst_index, src_base, dst_base, r0, rows, n_rows, words_per_row,
                VEC: tl.constexpr, BLOCK: tl.constexpr):
    # word e of the program: row e // W, byte (e % W) * VEC of that row; VEC divides every address here
    e = tl.arange(0, BLOCK // VEC)
    local = e // words_per_row
    col = (e - local * words_per_row).to(tl.int64) * VEC
    row = r0 + local
    live = (local < rows) & (row < n_rows)
    src = src_base + tl.load(src_index + row, mask=live, other=0)
    dst = dst_base + tl.load(dst_index + row, mask=live, other=0)
    src = src // VEC * VEC
    dst = dst // VEC * VEC
    lane = tl.arange(0, VEC)[None, :]
    mask = live[:, None]
    tl.store(anchor_ptr + (dst + col)[:, None] + lane,
             tl.load(anchor_ptr + (src + col)[:, None] + lane, mask=mask), mask=mask)


@triton.jit
def _flat_row_kernel(anchor_ptr, src_index, dst_index, src_base, dst_base, n_rows, length, rows, n_tiles,
                     ROWS_P2: tl.constexpr, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr):
    # ``rows`` whole rows per tile (rows * length <= BLOCK); persistent: a grid-stride loop over the tiles
    step = tl.num_programs(0) if PERSISTENT else n_tiles
    for tile in range(tl.program_id(0), n_tiles, step):
        r0 = tile * rows
        rr = r0 + tl.arange(0, ROWS_P2)
        live = (tl.arange(0, ROWS_P2) < rows) & (rr < n_rows)
        src = src_base + tl.load(src_index + rr, mask=live, other=0)
        dst = dst_base + tl.load(dst_index + rr, mask=live, other=0)
        low = tl.where(live, (src | dst | length) & 15, 0)
        vec = tl.min(tl.where(low == 0, 16, low & -low), axis=0)
        if vec == 16:
            _flat_words(anchor_ptr, src_index, dst_index, src_base, dst_base, r0, rows, n_rows, length // 16, 16,
                        BLOCK)
        elif vec == 8:
            _flat_words(anchor_ptr, src_index, dst_index, src_base, dst_base, r0, rows, n_rows, length // 8, 8,
                        BLOCK)
        elif vec == 4:
            _flat_words(anchor_ptr, src_index, dst_index, src_base, dst_base, r0, rows, n_rows, length // 4, 4,
                        BLOCK)
        elif vec == 2:
            _flat_words(anchor_ptr, src_index, dst_index, src_base, dst_base, r0, rows, n_rows, length // 2, 2,
                        BLOCK)
        else:
            _flat_words(anchor_ptr, src_index, dst_index, src_base, dst_base, r0, rows, n_rows, length, 1, BLOCK)


_FLAT = CompiledKernel(_flat_row_kernel, n_tensors=3)


def flat_row_copy(src_index: torch.Tensor, dst_index: torch.Tensor, src_base: int, dst_base: int, length: int,
                  block_bytes: int, num_warps: int, persistent: bool, programs: int):
    """A zero-argument callable enqueuing the flat-mapped copy of ``src_index.numel()`` rows of ``length`` bytes
    (row i: ``src_base + src_index[i]`` -> ``dst_base + dst_index[i]``, raw addresses) on the current stream.
    ``block_bytes`` (a power of two) per program, whole rows only; ``programs``: the grid of the persistent
    form. Raises ValueError for a row longer than ``block_bytes``."""
    if not 1 <= length <= block_bytes or block_bytes & (block_bytes - 1):
        raise ValueError(f"flat row copy: length {length} must be 1 .. block_bytes ({block_bytes}), a power of two")
    n = src_index.numel()
    rows = block_bytes // length
    n_tiles = -(-n // rows)
    grid = (min(n_tiles, programs) if persistent else n_tiles, 1)
    a = anchor(src_index.device)
    args = (a, src_index, dst_index, src_base - a.data_ptr(), dst_base - a.data_ptr(), n, length, rows, n_tiles)
    return _FLAT.bind(args, grid, dict(ROWS_P2=1 << max(0, rows - 1).bit_length(), BLOCK=block_bytes,
                                       PERSISTENT=persistent, num_warps=num_warps))


def candidates(length: int, src_index, dst_index, src_base: int, dst_base: int, programs: int) -> dict:
    out = {}
    for tile, max_cols, warps, split, pps in ROW_VARIANTS:
        settings = row_settings(length, tile, max_cols, warps, split, pps)
        if split and not settings.tail:
            continue  # split is a no-op at this length: the unsplit entry times it
        name = f"row:t{tile // 1024}k/c{max_cols}/w{warps}" + ("/split" if split else "") + \
            (f"/pps{pps}" if pps else "")
        out[name] = RowCopy(src_index, dst_index, src_base, dst_base, settings)
    for block, warps, persistent in FLAT_VARIANTS:
        if length <= block:
            name = f"flat:b{block // 1024}k/w{warps}" + ("/p" if persistent else "")
            out[name] = flat_row_copy(src_index, dst_index, src_base, dst_base, length, block, warps, persistent,
                                      programs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help="comma-separated row sizes (bytes)")
    parser.add_argument("--out", help="JSON-lines path (default: a temporary file)")
    parser.add_argument("--smoke", action="store_true", help="tiny pool, no timing (CPU interpreter)")
    args = parser.parse_args()
    smoke = args.smoke or INTERPRET
    if not smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else list(SIZES)
    pool_bytes, count = ((1 << 16), 16) if smoke else ((1 << 30), 32768)
    programs = 8 * (2 if smoke else torch.cuda.get_device_properties(device).multi_processor_count)
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out_path = args.out or os.path.join(tempfile.mkdtemp(prefix="pxn-row-sweep-"), "row-sweep.jsonl")
    meta = {"gpu": "interpreter" if smoke else torch.cuda.get_device_name(device), "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "seed": seed}
    print(f"row sweep: {meta}", flush=True)
    pool = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8, device=device, generator=gen)
    pool_before = pool.clone()
    failures = 0
    with open(out_path, "w") as f:
        for length in sizes:
            pool_rows = pool_bytes // length
            n = min(count, pool_rows)
            picks = torch.randperm(pool_rows, device=device, generator=gen)[:n]
            pool_offsets = (picks * length).contiguous()
            packed_offsets = torch.arange(n, device=device, dtype=torch.int64) * length
            total = n * length
            chunk = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=gen)
            out = torch.empty(total, dtype=torch.uint8, device=device)
            rows_view = pool[:pool_rows * length].view(pool_rows, length)
            expect_gather = rows_view[picks].reshape(-1).clone()
            expect_pool = pool.clone()
            expect_pool[:pool_rows * length].view(pool_rows, length).index_copy_(0, picks, chunk.view(n, length))
            base = {"row_bytes": length, "n_rows": n, "total_bytes": total, "pool_bytes": pool_bytes, **meta}
            seconds = {}
            if not smoke:
                dtype = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                             if length % d.itemsize == 0)
                pool_view = pool[:pool_rows * length].view(dtype).view(pool_rows, -1)
                out_view, chunk_view = out.view(dtype).view(n, -1), chunk.view(dtype).view(n, -1)
                contiguous_src, contiguous_dst = chunk.clone(), torch.empty_like(chunk)
                repeats = max(20, min(300, int(0.01 / max(5e-6, 2 * total / 3e12))))
                seconds["contiguous"] = timed(lambda: contiguous_dst.copy_(contiguous_src), repeats)
                seconds["gather"] = timed(lambda: torch.index_select(pool_view, 0, picks, out=out_view), repeats)
                seconds["scatter"] = timed(lambda: pool_view.index_copy_(0, picks, chunk_view), repeats)
                pool.copy_(pool_before)
                for op in ("gather", "scatter"):
                    f.write(json.dumps(dict(base, op=op, method="index_select" if op == "gather" else "index_copy_",
                                            gbps=total / seconds[op] / 1e9)) + "\n")
                f.write(json.dumps(dict(base, op="copy", method="contiguous",
                                        gbps=total / seconds["contiguous"] / 1e9)) + "\n")
            for op in ("gather", "scatter"):
                if op == "gather":
                    calls = candidates(length, pool_offsets, packed_offsets, pool.data_ptr(), out.data_ptr(), programs)
                else:
                    calls = candidates(length, packed_offsets, pool_offsets, chunk.data_ptr(), pool.data_ptr(),
                                       programs)
                best = None
                for name, call in calls.items():
                    row = dict(base, op=op, method=name)
                    if op == "gather":
                        out.random_(0, 256, generator=gen)
                    else:
                        pool.copy_(pool_before)
                    call()
                    if not smoke:
                        torch.cuda.synchronize()
                    row["exact"] = bool(torch.equal(out, expect_gather) if op == "gather"
                                        else torch.equal(pool, expect_pool))
                    if not row["exact"]:
                        failures += 1
                        print(f"  {length} B {op} {name}: NOT byte-exact", flush=True)
                    elif not smoke:
                        s = timed(call, repeats)
                        row.update(gbps=total / s / 1e9, ratio_torch=seconds[op] / s,
                                   ratio_contiguous=seconds["contiguous"] / s)
                        if best is None or row["gbps"] > best["gbps"]:
                            best = row
                    f.write(json.dumps(row) + "\n")
                pool.copy_(pool_before)
                if best is not None:
                    print(f"  {length:>5} B {op:>7}: torch {total / seconds[op] / 1e9:7.1f} GB/s, contiguous "
                          f"{total / seconds['contiguous'] / 1e9:7.1f}, best {best['method']} {best['gbps']:7.1f} "
                          f"(x{best['ratio_torch']:.2f} torch, x{best['ratio_contiguous']:.2f} contiguous)",
                          flush=True)
            f.flush()
    print(f"wrote {out_path}" + (f"; {failures} candidate(s) NOT byte-exact" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
