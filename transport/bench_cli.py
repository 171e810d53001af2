"""``pxn bench``: the engine end to end on sglang's transfer shapes between two local processes.

A receiving engine runs in a spawned process (``LocalPeer``); this process is the sender. Each shape is written
``--repeat`` times into the peer's registered memory and the first write of every shape is verified byte for byte
(digest of the peer's whole buffer against the expected image). Fabric: ``--fabric auto`` picks ipc + GPU memory
when CUDA is available, else tcp + host memory. Prints GB/s per shape and where the time went (the engine's
``stats()``); ``--json PATH`` writes rows + stats.

``LocalPeer`` and ``measure`` are also used by ``benchmarks/relay_table.py`` and ``benchmarks/engine_gpu.py``.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import re
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from transport.config import MAX_RAILS, EngineConfig, unwritable
from transport.errors import ConfigError, PxnError, ShapesError
from transport.fabric import FABRICS
from transport.peer_process import POISON, Buffer, PeerProcess, digest, serve

log = logging.getLogger(__name__)

PACKAGED_SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sglang_shapes.json")
"""sglang's transfer shapes as recorded from the field (aux lengths, per-layer MLA block lengths), shipped with
the package."""
MLA_NAMES = ("mla_latent_1k", "mla_latent_8k", "mla_latent_64k")
MAX_PIECE_BYTES = 1 << 32
"""Largest length a shapes file may give one piece (4 GiB); larger is refused before any memory is taken."""
MAX_COUNT = 1 << 16
"""Most pieces (layers) a shapes file's ``count`` may give one MLA call."""
DEFAULT_LAYERS = 78
"""Layers per MLA call where neither ``--layers`` nor the shapes file's ``count`` says (GLM-5's 78)."""
MAX_REPEAT = 1_000_000
"""Most timed calls per shape ``--repeat`` may ask for."""


def shapes_path(path: Optional[str] = None) -> str:
    """The shapes file in effect: ``path``, else ``$PXN_SHAPES``, else the packaged copy."""
    return path or os.environ.get("PXN_SHAPES") or PACKAGED_SHAPES


def load_shapes(path: Optional[str] = None) -> dict:
    """Read a shapes file (format of ``transport/data/sglang_shapes.json``).

    Returns ``{"aux": [bytes, ...], "mla": {name: bytes per layer}, "count": {name: layers}, "path": file}``;
    ``count`` holds the MLA calls whose entry gives one (pieces of that length per call).
    Raises ``ShapesError`` naming the file and the bad field (a length over ``MAX_PIECE_BYTES`` too);
    nothing falls back silently.
    """
    path = shapes_path(path)
    try:
        with open(path, encoding="utf-8") as f:
            calls = json.load(f)["calls"]
        aux = [int(x) for x in calls["aux_metadata"]["lengths"]]
        mla = {k: int(calls[k]["length"]) for k in MLA_NAMES if k in calls}
        count = {k: calls[k]["count"] for k in MLA_NAMES if k in calls and "count" in calls[k]}
    except OSError as e:
        raise ShapesError(f"cannot read shapes file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ShapesError(f"shapes file {path} is not valid: {e}") from None
    except (KeyError, TypeError) as e:
        raise ShapesError(f"shapes file {path} lacks calls.aux_metadata.lengths or a length ({e})") from None
    if not aux or min(aux) < 1 or any(v < 1 for v in mla.values()):
        raise ShapesError(f"shapes file {path}: every length must be >= 1 byte (aux {aux}, mla {mla})")
    for i, n in enumerate(aux):
        if n > MAX_PIECE_BYTES:
            raise ShapesError(f"shapes file {path}: calls.aux_metadata.lengths[{i}] = {n} B is larger than "
                              f"{MAX_PIECE_BYTES >> 30} GiB")
    for k, n in mla.items():
        if n > MAX_PIECE_BYTES:
            raise ShapesError(f"shapes file {path}: calls.{k}.length = {n} B is larger than "
                              f"{MAX_PIECE_BYTES >> 30} GiB")
    for k, c in count.items():
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_COUNT:
            raise ShapesError(f"shapes file {path}: calls.{k}.count must be an int from 1 to {MAX_COUNT}, "
                              f"got {c!r}")
    return {"aux": aux, "mla": mla, "count": count, "path": path}


AUX = load_shapes(PACKAGED_SHAPES)["aux"]
"""Lengths (bytes) of sglang's aux call: 11 host pieces of 64 B to 8 KiB."""


def _peer_main(conn, sizes: Dict[str, tuple], engine_kwargs: dict, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="peer %(levelname)s %(name)s: %(message)s")
    state = {}

    def start():
        from transport.engine import TransferEngine
        engine = state["engine"] = TransferEngine(**engine_kwargs)
        mems = state["mems"] = {}
        for name, (nbytes, device) in sizes.items():
            mems[name] = Buffer(nbytes, device)
            engine.register(mems[name].addr, nbytes, device=device)
        return {"session": engine.session_id, "addrs": {k: m.addr for k, m in mems.items()}}

    def handle(cmd, kw):
        mems = state["mems"]
        if cmd == "poison":
            for m in mems.values():
                m.fill(POISON)
            if any(m.device >= 0 for m in mems.values()):
                import torch
                torch.cuda.synchronize()
            return None
        if cmd == "digest":
            if mems[kw["name"]].device >= 0:
                import torch
                torch.cuda.synchronize()
            return digest(mems[kw["name"]].host())
        if cmd == "stats":
            return state["engine"].stats()
        raise ValueError(f"unknown command {cmd!r}")

    serve(conn, start, handle, lambda: state["engine"].close())


class LocalPeer(PeerProcess):
    """A receiving ``TransferEngine`` in a spawned process with named registered buffers.

    Arguments:
        sizes: name -> (bytes, device) of each buffer to allocate (poisoned) and register.
        engine_kwargs: passed to the peer's TransferEngine.
    """

    def __init__(self, sizes: Dict[str, tuple], log_level: int = logging.WARNING, **engine_kwargs):
        super().__init__(_peer_main, (sizes, engine_kwargs, log_level), name="pxn-bench-peer",
                         start_timeout=180.0, call_timeout=300.0)
        self.session = self.ready["session"]
        self.addrs = self.ready["addrs"]


def sglang_shapes(layers: Optional[int] = None, device: int = -1, quick: bool = False,
                  path: Optional[str] = None) -> List[dict]:
    """The sglang call shapes: name, memory device, and (src_off, dst_off, length) lists into 'kv'/'aux' buffers.

    Offsets are relative to the sender's / peer's buffer of that memory kind. MLA calls are runs of one length
    (contiguous per layer): ``layers`` of them, else the shapes file's ``count`` for that call, else
    ``DEFAULT_LAYERS``; the MHA call is page-scattered 2 KiB pieces; aux is host memory.
    ``path``: shapes file (``load_shapes``); raises ``ShapesError`` when it cannot be used.
    """
    recorded = load_shapes(path)
    lengths, aux = recorded["mla"], recorded["aux"]
    rng = np.random.default_rng(1234)
    out = [{"name": "aux_metadata", "buffer": "aux", "device": -1, "src": np.cumsum([0] + aux[:-1]) * 2,
            "dst": np.cumsum([0] + aux[:-1]) * 2 + 16, "len": np.array(aux)}]
    for name, L in lengths.items():
        if quick and name == "mla_latent_64k":
            continue
        n = layers or recorded["count"].get(name, DEFAULT_LAYERS)
        out.append({"name": f"{name} ({n}x{L})", "buffer": "kv", "device": device,
                    "src": np.arange(n) * L, "dst": rng.permutation(n) * L,
                    "len": np.full(n, L)})
    n = 4096
    out.append({"name": "4096x64B", "buffer": "kv", "device": device, "src": rng.permutation(n) * 256,
                "dst": rng.permutation(n) * 64, "len": np.full(n, 64)})
    n = 8192 if quick else 32768
    out.append({"name": f"mha_pages ({n}x2KiB)", "buffer": "kv", "device": device,
                "src": rng.permutation(n) * 2048, "dst": rng.permutation(n) * 2048, "len": np.full(n, 2048)})
    small = rng.integers(1, 8193, size=2000)
    lens = np.concatenate([small, np.full(8, 2 << 20)])
    rng.shuffle(lens)
    off = np.concatenate(([0], np.cumsum((lens + 15) // 16 * 16)[:-1]))
    out.append({"name": "mix 1B-8KB + 8x2MB", "buffer": "kv", "device": device, "src": off,
                "dst": off.copy(), "len": lens})
    return out


def buffer_sizes(shapes: List[dict]) -> Dict[str, int]:
    need: Dict[str, int] = {}
    for s in shapes:
        end = int(max((s["src"] + s["len"]).max(), (s["dst"] + s["len"]).max()))
        need[s["buffer"]] = max(need.get(s["buffer"], 0), end)
    return need


def expecteddigest(src_host: np.ndarray, size: int, shape: dict) -> str:
    img = np.full(size, POISON, dtype=np.uint8)
    for s, d, n in zip(shape["src"].tolist(), shape["dst"].tolist(), shape["len"].tolist()):
        img[d:d + n] = src_host[s:s + n]
    return digest(img)


def measure(engine, session: str, src_addr: int, dst_addr: int, shape: dict, repeat: int, warmup: int = 1,
            sync=None) -> dict:
    """Write ``shape`` ``warmup + repeat`` times; returns seconds per call (median, best) and GB/s of the median.
    ``sync`` (optional) runs before each timed call (e.g. a CUDA synchronize)."""
    srcs = (src_addr + shape["src"]).tolist()
    dsts = (dst_addr + shape["dst"]).tolist()
    lens = shape["len"].tolist()
    nbytes = int(shape["len"].sum())
    times = []
    for i in range(warmup + repeat):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        engine.batch_write(session, srcs, dsts, lens)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    med = float(np.median(times))
    return {"bytes": nbytes, "pieces": len(lens), "median_s": med, "best_s": float(min(times)),
            "gbps": nbytes / med / 1e9, "gbps_best": nbytes / min(times) / 1e9}


# --- CLI ----------------------------------------------------------------------------------------------------
class FabricChoices:
    """``--fabric``'s choices: "auto" and every name of ``transport.fabric.FABRICS``. A value is checked against
    the table when it is given (a built-in name never reads the entry points); the list is made only for an
    error message."""

    def __contains__(self, name) -> bool:
        return name == "auto" or (isinstance(name, str) and name in FABRICS)

    def __iter__(self):
        return iter(("auto", *FABRICS))

    def __repr__(self) -> str:
        return ", ".join(self)


def add_arguments(parser) -> None:
    parser.add_argument("--fabric", default=None, choices=FabricChoices(), metavar="NAME",
                        help="auto, tcp, ipc, verbs or a fabric registered through the pxn.fabrics entry points; "
                             "auto: ipc + GPU memory when CUDA is available, else tcp + host memory "
                             "(default: $PXN_FABRIC, else auto)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"layers per MLA call, 1 to {MAX_COUNT} (default: each call's count in the shapes "
                             f"file, else {DEFAULT_LAYERS})")
    parser.add_argument("--repeat", type=int, default=3, help=f"timed calls per shape, 1 to {MAX_REPEAT} (default 3)")
    parser.add_argument("--quick", action="store_true", help="skip the 64k shape, fewer MHA pages")
    parser.add_argument("--rails", type=int, default=None,
                        help=f"rails (loopback fabric instances), 1 to {MAX_RAILS} (default: $PXN_RAILS, else 2)")
    parser.add_argument("--json", metavar="PATH", help="write rows and stats() as JSON here (its folder must exist)")
    parser.add_argument("--no-verify", action="store_true", help="skip the byte-exact check of each shape")
    parser.add_argument("--shapes", metavar="FILE", default=None,
                        help="sglang shapes JSON (default: $PXN_SHAPES, else the copy shipped in transport/data)")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="write plots here (default: beside --json; needs matplotlib)")


def _versions() -> dict:
    """The software of the run; torch and Triton by their installed versions, not imported for it (a tcp run on
    host memory never loads them)."""
    from importlib import metadata
    out = {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count()}
    torch = sys.modules.get("torch")
    for name in ("torch", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if torch is not None:
        out["torch"] = torch.__version__
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def _import_torch():
    """torch, or None where it cannot be imported. The import (seconds, partly in C++) runs with SIGINT blocked:
    a Ctrl-C inside torch's C++ start ends the process through std::terminate; blocked, it waits and arrives as
    a ``KeyboardInterrupt`` once the import is done (threads torch starts keep it blocked)."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    import signal
    import threading
    block = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if block else None
    try:
        import torch
        return torch
    except ImportError:
        return None
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _print(msg: str = "") -> None:
    print(msg, flush=True)


class Progress:
    """``shape i of n, elapsed`` on stderr, once a run has taken longer than ``after_s`` seconds (quiet runs
    stay quiet; long ones show they are alive)."""

    def __init__(self, after_s: float = 3.0, stream=None):
        self.t0 = time.perf_counter()
        self.after_s = after_s
        self.stream = stream

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def note(self, msg: str) -> bool:
        """Print ``msg`` with the elapsed time if the run is long enough; returns whether it printed."""
        if self.elapsed() < self.after_s:
            return False
        print(f"pxn bench: {msg} ({self.elapsed():.1f} s elapsed)", file=self.stream or sys.stderr, flush=True)
        return True


def _fail(msg: str) -> int:
    """One line on stderr, exit status 2 (bad input or environment)."""
    print(f"pxn bench: error: {msg}", file=sys.stderr)
    return 2


def _one_line(e: BaseException) -> str:
    """An error as one line, in words: a peer's error carries its traceback after the first line and the class
    name of the error in the peer; an OS error is its reason and file."""
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        line = f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    # the peer process reports its error as "ClassName: message": the message is what the user needs
    return re.sub(r"\b[A-Z][A-Za-z]*(?:Error|Exception|Unavailable|Closed|Lost|Gone|Rejected|Timeout|Session): ", "",
                  line)


def _fabric_choice(args) -> str:
    """``--fabric``, else ``$PXN_FABRIC``, else auto, as the engine reads it. Raises ``ConfigError`` naming the
    variable and its value when it names no fabric."""
    if args.fabric is not None:
        return args.fabric
    text = EngineConfig.read(("fabric",)).get("fabric", "")
    if text.strip() == "":
        return "auto"
    if text.strip() not in FabricChoices():
        raise ConfigError(f"environment variable PXN_FABRIC={text!r}: not a fabric ({', '.join(FabricChoices())})")
    return text.strip()


def _available_host_memory() -> Optional[int]:
    """Bytes of host memory a new allocation can get: ``MemAvailable`` (free memory and reclaimable cache) where
    /proc/meminfo has it, else the free pages; None when neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _memory_check(shapes: List[dict], need: Dict[str, int], device: int) -> Optional[str]:
    """Why the buffers of a run do not fit this machine (None when they do): the sender and the peer each hold
    every buffer, so host memory must hold twice the sum (GPU memory, for GPU buffers, as well)."""
    host = 2 * sum(v for k, v in need.items() if all(s["device"] < 0 for s in shapes if s["buffer"] == k))
    gpu = 2 * sum(v for k, v in need.items() if any(s["device"] >= 0 for s in shapes if s["buffer"] == k))
    avail_host = _available_host_memory()
    avail_gpu = None
    if gpu:
        import torch
        avail_gpu = torch.cuda.mem_get_info(device)[0]
    biggest = max(shapes, key=lambda s: int(s["len"].sum()))
    for kind, want, have in (("host", host, avail_host), ("GPU", gpu, avail_gpu)):
        if want and have is not None and want > have:
            return (f"the shapes need {want / 2**30:.1f} GiB of {kind} memory (sender and peer), "
                    f"{have / 2**30:.1f} GiB is free; the largest call is {biggest['name']}, "
                    f"{int(biggest['len'].sum()) / 2**30:.1f} GiB")
    return None


def _check_arguments(args) -> Optional[str]:
    """Why the command line cannot run (None when it can): counts out of range, an output path that cannot be
    written. Checked before any work: a run of minutes must not end in a refusal of its output path."""
    for name, most in (("repeat", MAX_REPEAT), ("layers", MAX_COUNT), ("rails", MAX_RAILS)):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= most:
            return f"--{name} {value}: must be from 1 to {most}"
    for option, path in (("--json", args.json), ("--plot", _plot_path(args))):
        why = unwritable(path) if path else None
        if why:
            via = "" if option == "--json" or args.plot else f" (beside --json {args.json})"
            return f"{option} {path}{via}: cannot write there: {why}"
    return None


def _plot_path(args) -> Optional[str]:
    """``--plot``, else beside ``--json``, else None (no plots)."""
    return args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)


class _Setup:
    """What a run moves and where: the fabric (auto resolved), the memory kind, the shapes and their buffers."""

    def __init__(self, args, fabric: str):
        self.torch = _import_torch() if fabric != "tcp" else None  # tcp moves host memory: torch is not needed
        cuda = self.torch is not None and self.torch.cuda.is_available()
        if fabric == "auto":
            fabric = "ipc" if cuda else "tcp"
        self.fabric = fabric
        self.device = 0 if (cuda and fabric in ("ipc", "verbs")) else -1
        self.engine_kwargs = {"fabric": fabric, **({"rails": args.rails} if args.rails else {})}
        self.shapes = sglang_shapes(args.layers, self.device, args.quick, path=args.shapes)
        self.need = buffer_sizes(self.shapes)
        self.devs = {s["buffer"]: s["device"] for s in self.shapes}

    def sync(self):
        """What runs before each timed call: a CUDA synchronize for GPU memory."""
        torch = self.torch
        return (lambda: torch.cuda.synchronize()) if self.device >= 0 else None


def _run_shapes(setup: _Setup, args, progress: Progress) -> tuple:
    """Every shape through a sender engine here and a ``LocalPeer``: (rows, sender stats, peer stats). The
    first call of each shape is checked byte for byte unless ``--no-verify``."""
    from transport.engine import TransferEngine
    need, devs, kw = setup.need, setup.devs, setup.engine_kwargs
    rows = []
    # This process's engine first: a fabric this machine cannot run fails here, in one line, before a
    # peer process is spawned.
    with TransferEngine(**kw) as eng, LocalPeer({k: (v, devs[k]) for k, v in need.items()}, **kw) as peer:
        srcs = {k: Buffer(v, devs[k], random_seed=7 + i) for i, (k, v) in enumerate(sorted(need.items()))}
        for m in srcs.values():
            eng.register(m.addr, m.nbytes, device=m.device)
        for i, shape in enumerate(setup.shapes):
            progress.note(f"shape {i + 1} of {len(setup.shapes)}: {shape['name']}")
            buf = shape["buffer"]
            verified = "skipped" if args.no_verify else _verify(eng, peer, srcs[buf], shape, need[buf])
            r = measure(eng, peer.session, srcs[buf].addr, peer.addrs[buf], shape, args.repeat,
                        warmup=0 if not args.no_verify else 1, sync=setup.sync())
            r.update({"shape": shape["name"], "verified": verified})
            rows.append(r)
            _print(f"  [{i + 1}/{len(setup.shapes)}] {shape['name']:<32} {r['gbps']:8.3f} GB/s  "
                   f"{r['median_s'] * 1e3:9.2f} ms/call  {verified}")
        return rows, eng.stats(), peer.call("stats")


def _verify(eng, peer, src: Buffer, shape: dict, size: int) -> str:
    """One call of ``shape`` into the poisoned peer, its whole buffer compared by digest with the expected image."""
    buf = shape["buffer"]
    peer.call("poison")
    eng.batch_write(peer.session, (src.addr + shape["src"]).tolist(), (peer.addrs[buf] + shape["dst"]).tolist(),
                    shape["len"].tolist())
    ok = peer.call("digest", name=buf) == expecteddigest(src.host(), size, shape)
    return "byte-exact" if ok else "MISMATCH"


def _print_report(rows: List[dict], stats: dict, peer_stats: dict, progress: Progress) -> None:
    """The table of shapes and where the time went, on stdout."""
    _print()
    _print(f"{'shape':<34}{'pieces':>8}{'MB':>10}{'ms/call':>10}{'GB/s':>9}  check")
    for r in rows:
        _print(f"{r['shape']:<34}{r['pieces']:>8}{r['bytes'] / 1e6:>10.2f}{r['median_s'] * 1e3:>10.2f}"
               f"{r['gbps']:>9.3f}  {r['verified']}")
    _print()
    _print("where the time went (sender, seconds summed over all calls):")
    for k, v in sorted(stats["time_s"].items(), key=lambda kv: -kv[1]):
        _print(f"  {k:<14}{v:10.3f}")
    p = stats["paths"]
    _print(f"paths: direct {p['direct']['units']} writes / {p['direct']['bytes'] / 1e6:.1f} MB, relayed "
           f"{p['relayed']['units']} / {p['relayed']['bytes'] / 1e6:.1f} MB, coalesced {p['coalesced']['chunks']} "
           f"chunks of {p['coalesced']['items']} pieces / {p['coalesced']['bytes'] / 1e6:.1f} MB")
    lat = stats["batches"]["latency"]
    _print(f"batch latency: p50 {lat['p50_ms']} ms, p90 {lat['p90_ms']} ms, p99 {lat['p99_ms']} ms "
           f"({lat['count']} batches)")
    rx = peer_stats["receiver"]
    _print(f"receiver: {rx.get('chunks', 0)} chunks, validate {rx.get('validate_s', 0):.3f} s, scatter "
           f"{rx.get('scatter_s', 0):.3f} s, rejected {rx.get('rejected', 0)}")
    _print(f"total {progress.elapsed():.1f} s")


def _write_outputs(doc: dict, args) -> Optional[str]:
    """``--json`` and the plots; why the JSON could not be written, else None."""
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
        except OSError as e:
            return f"cannot write {args.json}: {e.strerror or e}"
        _print(f"wrote {args.json}")
    plot_path = _plot_path(args)
    if plot_path:
        from transport import plots
        for written in plots.plot_bench(doc, plot_path):
            _print(f"wrote {written}")
    return None


def run(args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    why = _check_arguments(args)
    if why:
        return _fail(why)
    try:
        fabric = _fabric_choice(args)
        EngineConfig.from_env(fabric=None if fabric == "auto" else fabric, rails=args.rails)  # every PXN_* value
        setup = _Setup(args, fabric)
    except PxnError as e:  # ConfigError, ShapesError
        return _fail(str(e))
    why = _memory_check(setup.shapes, setup.need, setup.device)
    if why:
        return _fail(why)
    source = " (PXN_FABRIC)" if args.fabric is None and EngineConfig.read(("fabric",)).get("fabric", "").strip() \
        else ""
    _print(f"pxn bench: fabric {setup.fabric}{source}, {'GPU cuda:0' if setup.device >= 0 else 'host'} memory, "
           f"{len(setup.shapes)} shapes x {args.repeat} calls; starting the peer process...")
    progress = Progress()
    try:
        rows, stats, peer_stats = _run_shapes(setup, args, progress)
    except BrokenPipeError:
        raise  # the reader of stdout is gone: the CLI stops quietly
    except (PxnError, RuntimeError, OSError) as e:
        return _fail(_one_line(e))
    _print_report(rows, stats, peer_stats, progress)
    doc = {"fabric": setup.fabric, "memory": "gpu" if setup.device >= 0 else "host",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           **_versions(), "shapes_file": os.path.basename(shapes_path(args.shapes)),
           "rows": rows, "stats": stats, "peer_stats": peer_stats}
    why = _write_outputs(doc, args)
    if why:
        return _fail(why)
    return 0 if all(r["verified"] != "MISMATCH" for r in rows) else 1
