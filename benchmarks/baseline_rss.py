"""The memory every pxn process carries before it moves a byte: resident set size (VmRSS) of a fresh interpreter,
after ``import torch``, after importing pxn's engine (torch, Triton, numpy and the transport), and with one idle
engine (tcp, one rail: what a receive-only engine holds before any sender arrives).

Each stage is measured in its own fresh process, ``--repeat`` times; the JSON holds every sample and the median.

    python benchmarks/baseline_rss.py --out benchmarks/results/baseline-rss-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
stage = sys.argv[1]
out = {"python": rss()}
if stage in ("torch", "engine", "idle_engine"):
    import torch
    out["torch"] = rss()
    out["torch_version"] = torch.__version__
if stage in ("engine", "idle_engine"):
    from transport.engine import TransferEngine
    out["engine_imports"] = rss()
if stage == "idle_engine":
    eng = TransferEngine(fabric="tcp", rails=1)
    out["idle_engine"] = rss()
    eng.close()
if "torch_version" in out:
    import torch
    out["cuda"] = torch.cuda.is_available()   # last: it loads the driver, which no stage above needs
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    samples = {}
    extra = {}
    for _ in range(args.repeat):
        got = json.loads(subprocess.run([sys.executable, "-c", CHILD, "idle_engine"], env=env, check=True,
                                        capture_output=True, text=True).stdout)
        for k in ("python", "torch", "engine_imports", "idle_engine"):
            samples.setdefault(k, []).append(round(got[k], 1))
        extra = {"torch_version": got["torch_version"], "cuda": got["cuda"]}
    result = {"what": "VmRSS (MiB) of one process, each stage after the one before, fresh process per sample",
              "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "machine": platform.node(),
              "cpus": os.cpu_count(), **extra,
              "median_mib": {k: statistics.median(v) for k, v in samples.items()}, "samples_mib": samples}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
