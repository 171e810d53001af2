"""PNG plots of benchmark JSON: ``pxn bench``, the kernel benchmark, the fabrics and peers comparisons, the relay
table (and the relay table as the README's Markdown, from the same cells), a receiver's cost against its number
of peers (``benchmarks/scale.py``).

matplotlib is optional (``pip install -e ".[bench]"``): without it every ``plot_*`` logs one line and writes
nothing. Each function takes the JSON document as the benchmark wrote it and a PNG path, and returns the list
of files it wrote. ``plot_any`` picks the right one from the document's shape (``benchmarks/plots.py``).
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional

log = logging.getLogger(__name__)
_warned = False


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (logged once) when matplotlib is missing."""
    global _warned
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _warned:
            log.warning("matplotlib is not installed: no plots written (pip install matplotlib)")
            _warned = True
        return None
    return plt


def _save(fig, path: str) -> List[str]:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.tight_layout()
    # A fixed creation date and no software tag: the same JSON renders to the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt
    plt.close(fig)
    return [path]


def _subtitle(doc: dict) -> str:
    parts = [str(doc.get(k)) for k in ("gpu", "fabric", "memory") if doc.get(k)]
    if doc.get("torch"):
        parts.append("torch " + str(doc["torch"]))
    if doc.get("date"):
        parts.append(str(doc["date"])[:10])
    return ", ".join(parts)


def batch_breakdown(stats: dict, peer_stats: Optional[dict] = None) -> Dict[str, float]:
    """Milliseconds per batch spent in each stage, from ``TransferEngine.stats()`` (sender) and, when given,
    the receiving engine's ``stats()`` (``receiver`` keys). Stages run in different threads and overlap."""
    n = max(1, int(stats.get("batches", {}).get("submitted", 0) or 0))
    out = {f"sender {k}": v * 1e3 / n for k, v in stats.get("time_s", {}).items()}
    rx = (peer_stats or {}).get("receiver", {})
    for k in ("queue", "validate", "scatter", "ack"):
        if f"{k}_s" in rx:
            out[f"receiver {k}"] = rx[f"{k}_s"] * 1e3 / n
    return out


def plot_bench(doc: dict, path: str) -> List[str]:
    """``pxn bench`` JSON: GB/s per shape, and where a batch's time goes (ms per batch by stage)."""
    plt = _pyplot()
    if plt is None:
        return []
    rows = doc["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [r["shape"] for r in rows][::-1]
    a.barh(names, [r["gbps"] for r in rows][::-1], color="#3b75af")
    a.set_xscale("log")
    a.set_xlabel("GB/s (median call; log scale)")
    a.set_title("two processes: GB/s per sglang shape")
    for y, r in enumerate(rows[::-1]):
        a.text(r["gbps"], y, f" {r['gbps']:,.0f}" if r["gbps"] >= 100 else f" {r['gbps']:.3g}", va="center",
               fontsize=8)
    parts = batch_breakdown(doc.get("stats", {}), doc.get("peer_stats"))
    parts = dict(sorted(parts.items(), key=lambda kv: kv[1]))
    b.barh(list(parts), list(parts.values()),
           color=["#c44e52" if k.startswith("receiver") else "#55a868" for k in parts])
    b.set_xlabel("ms per batch (thread time summed; stages overlap)")
    lat = doc.get("stats", {}).get("batches", {}).get("latency", {})
    b.set_title(f"where a batch's time goes (batch p50 {float(lat.get('p50_ms', 0)):.3g} ms)")
    fig.suptitle(_subtitle(doc), fontsize=9)
    return _save(fig, path)


_METHOD_LABEL = {"pxn": "pxn gather", "contiguous": "one contiguous copy_", "batch_api": "cudaMemcpyBatchAsync",
                 "per_item": "per-item copy_", "index_select": "torch.index_select"}


def _bars(ax, rows: List[dict], mixes: List[str], methods: List[str]) -> None:
    """Grouped bars, one group per mix, one bar per method, with x labels that do not overlap."""
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [next((r["gbps"] for r in rows if r["mix"] == mix and r["method"] == m), 0) for mix in mixes]
        ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(mixes))], vals, width,
               label=_METHOD_LABEL[m])
    ax.set_xticks(range(len(mixes)))
    ax.set_xticklabels(mixes, rotation=30, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_xlim(-0.6, len(mixes) - 0.4)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s of payload (log scale)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_kernels(rows: List[dict], path: str, op: str = "gather") -> List[str]:
    """Kernel benchmark rows: GB/s by mix (piece size) for pxn against a contiguous copy and the peers; the
    rows of a paged pool (mixes ``rowsNB``, against ``torch.index_select``) in a panel of their own."""
    plt = _pyplot()
    if plt is None:
        return []
    rows = [r for r in rows if r.get("op") == op]

    def by_piece(m):
        return next(r["total_bytes"] / r["n_items"] for r in rows if r["mix"] == m)
    mixes = sorted({r["mix"] for r in rows if not r["mix"].startswith("rows")}, key=by_piece)
    paged = sorted({r["mix"] for r in rows if r["mix"].startswith("rows")}, key=by_piece)
    panels = [p for p in ((mixes, ("pxn", "contiguous", "batch_api", "per_item"),
                           "batches of pieces (by mean piece size)"),
                          (paged, ("pxn", "contiguous", "index_select"),
                           "rows of a paged pool picked at random (row size)")) if p[0]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.6 * len(panels) + 0.4), squeeze=False)
    for ax, (names, wanted, title) in zip(axes[:, 0], panels):
        methods = [m for m in wanted if any(r["method"] == m and r["mix"] in names for r in rows)]
        _bars(ax, rows, names, methods)
        ax.set_title(title, fontsize=9)
    first = rows[0] if rows else {}
    fig.suptitle(f"{op}: pxn against a contiguous copy and per-piece copies ({first.get('gpu', '')}, "
                 f"{first.get('date', '')})", fontsize=10)
    return _save(fig, path)


def plot_fabrics(rows: List[dict], path: str) -> List[str]:
    """Fabrics comparison rows: GB/s by shape for pxn's fabrics and the other transfer engines."""
    plt = _pyplot()
    if plt is None:
        return []
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(1, len(systems))
    failed = []
    for i, sysname in enumerate(systems):
        xs = [x + (i - (len(systems) - 1) / 2) * width for x in range(len(shapes))]
        vals = [next((r.get("gbps") for r in rows if r["shape"] == s and r["system"] == sysname), None)
                for s in shapes]
        bars = ax.bar(xs, [v or 0 for v in vals], width, label=sysname)
        failed += [(x, bars.patches[0].get_facecolor()) for x, v in zip(xs, vals) if not v]
    # A system with no figure for a shape failed it (the benchmark leaves such a row out or gives its error):
    # say so where its bar would be, rather than leave a gap that reads as "not measured".
    for x, color in failed:
        ax.text(x, 0.02, "✕ failed", transform=ax.get_xaxis_transform(), rotation=90, ha="center", va="bottom",
                fontsize=8, color=color, fontweight="bold")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (log scale)")
    machine = rows[0].get("machine", {}) if rows else {}
    ax.set_title(f"two processes, host memory: GB/s by shape ({machine.get('cores', '?')} cores, "
                 f"{str(rows[0].get('date', ''))[:10] if rows else ''})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def relay_table_grid(rows: List[dict]):
    """The relay table's cells: ``(piece sizes, columns, grid)``, columns ``(path, slot bytes or None)`` (each
    relayed slot size, direct, coalesced with the largest slot), ``grid[piece][column]`` GB/s or NaN. The heat
    map and the README's table are both drawn from this, so they show the same run."""
    rows = [r for r in rows if r["path"] in ("relayed", "direct", "coalesced")]
    pieces = sorted({r["piece_bytes"] for r in rows})
    relay_slots = sorted({r["slot_bytes"] for r in rows if r["path"] == "relayed"})
    cols = [("relayed", s) for s in relay_slots] + [("direct", None)]
    coalesced = sorted({r["slot_bytes"] for r in rows if r["path"] == "coalesced"})
    if coalesced:
        cols.append(("coalesced", coalesced[-1]))
    grid = [[next((r["gbps"] for r in rows if r["piece_bytes"] == p and r["path"] == path_
                   and (slot is None or r["slot_bytes"] == slot)), float("nan")) for path_, slot in cols]
            for p in pieces]
    return pieces, cols, grid


def relay_table_markdown(rows: List[dict]) -> str:
    """The relay table as the Markdown table the README shows (GB/s, two decimals; "–" for no cell)."""
    pieces, cols, grid = relay_table_grid(rows)
    head = ["piece"] + [f"{p} ({_size(s)} slot)" if s else p for p, s in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, row in zip(pieces, grid):
        lines.append("| " + " | ".join([_size(p)] + [f"{v:.2f}" if v == v else "–" for v in row]) + " |")
    return "\n".join(lines)


def plot_relay_table(rows: List[dict], path: str) -> List[str]:
    """Relay table rows as a heat map: piece size (rows) x path and slot size (columns), GB/s in each cell."""
    plt = _pyplot()
    if plt is None:
        return []
    pieces, cols, grid = relay_table_grid(rows)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{p}\n{_size(s)} slot" if s else p for p, s in cols], fontsize=8)
    ax.set_yticks(range(len(pieces)))
    ax.set_yticklabels([_size(p) for p in pieces])
    ax.set_ylabel("piece size")
    top = max((v for row in grid for v in row if v == v), default=1.0)
    for y, row in enumerate(grid):
        for x, v in enumerate(row):
            if v == v:
                ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=8,
                        color="black" if v > 0.6 * top else "white")
    fig.colorbar(im, ax=ax, label="GB/s")
    first = rows[0] if rows else {}
    ax.set_title(f"relay table, {first.get('fabric', '')} fabric: GB/s ({str(first.get('date', ''))[:10]})",
                 fontsize=10)
    return _save(fig, path)


def plot_scale(doc: dict, path: str) -> List[str]:
    """``benchmarks/scale.py``'s rows against N peers: time to first byte, receiver RSS, landing bytes, threads,
    file descriptors, aux11 latency under the load of the other N - 1 (p50 and p99)."""
    plt = _pyplot()
    if plt is None:
        return []
    rows = sorted(doc["rows"], key=lambda r: r["peers"])
    ns = [r["peers"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    series = [("ttfb_ms_median", "time to first byte, median (ms)"), ("rss_mib", "receiver RSS (MiB)"),
              ("landing_bytes", "landing memory (MiB)"), ("threads", "receiver threads"), ("fds", "receiver fds"),
              ("aux11_ms_p50", "aux11 under load, p50 / p99 (ms)")]
    for ax, (key, title) in zip(axes.flat, series):
        scale = 2 ** -20 if key == "landing_bytes" else 1
        ax.plot(ns, [r[key] * scale for r in rows], "o-", label=key)
        ax.set_ylim(bottom=0, top=max(r[key] * scale for r in rows) * 1.15 or 1)
        if key == "rss_mib" and all("rss_pxn_mib" in r for r in rows):
            # less the destination buffer the senders wrote into (the user's memory, 1 MiB per sender)
            ax.plot(ns, [r["rss_pxn_mib"] for r in rows], "s--", label="rss_pxn_mib")
            ax.legend()
        if key == "aux11_ms_p50":
            ax.plot(ns, [r["aux11_ms_p99"] for r in rows], "s--", label="aux11_ms_p99")
            ax.set_ylim(bottom=0, top=max(r["aux11_ms_p99"] for r in rows) * 1.15 or 1)
            ax.legend()
        ax.set_title(title, fontsize=10)
        if len(ns) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("peers (N)")
        ax.grid(True, alpha=0.3)
    setup = doc.get("setup", {})
    fig.suptitle(f"pxn receiver cost vs peers ({setup.get('fabric', 'tcp')}, {setup.get('rails', 1)} rail; "
                 f"{str(doc.get('date', ''))[:10]})")
    return _save(fig, path)


def plot_any(doc, path: str) -> List[str]:
    """Render a benchmark JSON document of any of the kinds above; [] for a kind without a plot."""
    if isinstance(doc, dict) and doc.get("benchmark") == "scale" and doc.get("rows"):
        return plot_scale(doc, path)
    if isinstance(doc, dict) and {"rows", "stats", "peer_stats"} <= doc.keys():
        rows = [r for r in doc["rows"] if "gbps" in r]  # engine_gpu.py adds ratio rows without GB/s
        return plot_bench(dict(doc, rows=rows), path) if rows else []
    if isinstance(doc, list) and doc and isinstance(doc[0], dict):
        keys = doc[0].keys()
        if {"mix", "op", "method", "gbps"} <= keys:
            return plot_kernels(doc, path)
        if {"piece_bytes", "slot_bytes", "path", "gbps"} <= keys:
            return plot_relay_table(doc, path)
        if {"shape", "system", "gbps"} <= keys:
            return plot_fabrics(doc, path)
    return []
