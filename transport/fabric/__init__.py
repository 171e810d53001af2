"""Fabrics: one verbs-shaped interface (``base.Fabric``), three built-in implementations (tcp, ipc, verbs), and
more by registration.

``FABRICS`` is the one table of fabric names: name -> class, read by everything that names a fabric (the engine,
``EngineConfig``, ``pxn bench``, the benchmarks). Its entries are classes or ``"module:Class"`` paths imported on
the first lookup, so importing this package never needs pyverbs or CUDA. Beyond the built-in names:

* ``register_fabric(name, cls_or_path)`` adds one from code;
* a distribution adds one by declaring an entry point in the group ``pxn.fabrics`` (``name = "module:Class"``).
  Entry points are read once, at the first lookup of a name the table does not hold (or a listing of every
  name); the module behind one is imported only when its name is looked up. A built-in or registered name wins
  over an entry point of the same name.

``make_fabric(name, hostname="127.0.0.1", **options)`` builds one by name.
"""
from __future__ import annotations

import importlib
import logging
import threading
from typing import Dict, Iterator, Tuple, Union

from transport.errors import FabricUnavailable
from transport.fabric.base import (  # noqa: F401
    DEVICE_HOST, Capabilities, Completion, Endpoint, Fabric, MemoryRegion, Opcode, RemoteRegion, WriteRequest,
)

__all__ = ["DEVICE_HOST", "Capabilities", "Completion", "Endpoint", "Fabric", "MemoryRegion", "Opcode", "RemoteRegion",
           "WriteRequest", "FABRICS", "ENTRY_POINT_GROUP", "fabric_class", "fabric_names", "make_fabric",
           "register_fabric"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pxn.fabrics"
"""The entry-point group a distribution declares its fabrics in: ``name = "package.module:FabricClass"``."""

BUILT_IN = {"tcp": "transport.fabric.tcp:TcpFabric", "ipc": "transport.fabric.ipc:IpcFabric",
            "verbs": "transport.fabric.verbs:VerbsFabric"}


class FabricRegistry:
    """Fabric name -> ``Fabric`` subclass. ``name in FABRICS`` and ``FABRICS[name]`` read entry points on a miss;
    ``FABRICS[name]`` imports the class (``FabricUnavailable`` naming the entry point or path when that fails,
    ``KeyError`` for an unknown name); iteration gives every name, built-in first."""

    def __init__(self, built_in: Dict[str, str], group: str):
        self._group = group
        self._lock = threading.Lock()
        self._table: Dict[str, Union[type, str, object]] = dict(built_in)  # class, "module:Class" or EntryPoint
        self._origin: Dict[str, str] = {name: f"built-in {path}" for name, path in built_in.items()}
        self._entry_points_read = False

    # --- the table ---------------------------------------------------------------------------------------------
    def register(self, name: str, cls_or_path, origin: str = "register_fabric") -> None:
        if not isinstance(name, str) or not name or name == "auto" or not name.isprintable() or " " in name:
            raise ValueError(f"fabric name must be a non-empty word other than 'auto', got {name!r}")
        if isinstance(cls_or_path, str):
            if cls_or_path.count(":") != 1:
                raise ValueError(f"fabric {name!r}: path must be 'module:Class', got {cls_or_path!r}")
        elif not (isinstance(cls_or_path, type) and issubclass(cls_or_path, Fabric)):
            raise TypeError(f"fabric {name!r}: expected a Fabric subclass or a 'module:Class' path, "
                            f"got {cls_or_path!r}")
        with self._lock:
            held = self._table.get(name)
            if held is not None and held != cls_or_path and not self._is_entry_point(name):
                raise ValueError(f"fabric name {name!r} is taken ({self._origin[name]})")
            self._table[name] = cls_or_path
            self._origin[name] = f"{origin} {cls_or_path}" if isinstance(cls_or_path, str) else origin

    def _is_entry_point(self, name: str) -> bool:
        return self._origin.get(name, "").startswith("entry point")

    def _read_entry_points(self) -> None:
        """Add the group's entry points, once; one that names a held name is skipped with a warning. A failure
        to read the installed distributions' metadata is logged, not raised: it must not break the built-ins."""
        with self._lock:
            if self._entry_points_read:
                return
            self._entry_points_read = True
            try:
                from importlib.metadata import entry_points
                found = list(entry_points(group=self._group))
            except Exception as e:  # noqa: BLE001 - a broken metadata file elsewhere must not break pxn
                log.warning("cannot read the %s entry points: %s: %s", self._group, type(e).__name__, e)
                return
            for ep in found:
                where = f"entry point {self._group}: {ep.name} = {ep.value}"
                dist = getattr(ep, "dist", None)
                if dist is not None:
                    where += f" (distribution {dist.metadata['Name']} {dist.version})"
                if ep.name in self._table:
                    log.warning("%s ignored: the name is taken (%s)", where, self._origin[ep.name])
                    continue
                self._table[ep.name] = ep
                self._origin[ep.name] = where

    def __contains__(self, name) -> bool:
        if name not in self._table:
            self._read_entry_points()
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        self._read_entry_points()
        return iter(list(self._table))

    def __len__(self) -> int:
        self._read_entry_points()
        return len(self._table)

    def names(self) -> Tuple[str, ...]:
        """Every fabric name: built-in, registered, then those of entry points."""
        return tuple(self)

    def __getitem__(self, name: str) -> type:
        if name not in self:
            raise KeyError(name)
        target = self._table[name]
        if isinstance(target, type):
            return target
        cls = self._load(name, target)
        with self._lock:
            if self._table.get(name) is target:
                self._table[name] = cls  # imported once
        return cls

    def _load(self, name: str, target) -> type:
        """The class behind a path or an entry point; ``FabricUnavailable`` naming where it came from and why it
        cannot be had (the import failed, or the object is no ``Fabric`` subclass)."""
        origin = self._origin[name]
        try:
            if isinstance(target, str):
                module, _, attr = target.partition(":")
                cls = getattr(importlib.import_module(module), attr)
            else:
                cls = target.load()
        except FabricUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a plugin's import is reported, with its name
            raise FabricUnavailable(f"fabric {name!r} ({origin}) cannot be loaded: {type(e).__name__}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, Fabric)):
            raise FabricUnavailable(f"fabric {name!r} ({origin}) is {cls!r}, not a transport.fabric.base.Fabric "
                                    f"subclass")
        return cls

    def __repr__(self) -> str:
        return f"FabricRegistry({', '.join(self._table)})"


FABRICS = FabricRegistry(BUILT_IN, ENTRY_POINT_GROUP)
"""The table of fabric names (see the module docstring)."""


def fabric_names() -> Tuple[str, ...]:
    """Every fabric name this process can build (reads the entry points once)."""
    return FABRICS.names()


def register_fabric(name: str, cls_or_path) -> None:
    """Add fabric ``name``: a ``Fabric`` subclass or a ``"module:Class"`` path imported on first use. Then
    ``make_fabric(name)``, ``TransferEngine(fabric=name)``, ``PXN_FABRIC=name`` and ``pxn bench --fabric name``
    take it. Registering a taken name again raises ``ValueError`` (the same target again is a no-op); an entry
    point of that name is replaced."""
    FABRICS.register(name, cls_or_path)


def fabric_class(name: str):
    """The implementation class of fabric ``name`` (imported on demand). ``ValueError`` for an unknown name,
    ``FabricUnavailable`` when a registered one cannot be imported."""
    try:
        return FABRICS[name]
    except KeyError:
        raise ValueError(f"unknown fabric {name!r}; expected one of {', '.join(FABRICS)}") from None


def make_fabric(name: str, hostname: str = "127.0.0.1", **options) -> Fabric:
    """Build the fabric called ``name`` (``fabric_names()``: "tcp", "ipc", "verbs" and registered ones) bound to
    ``hostname``.

    ``options`` go to the implementation: tcp/ipc take ``port``, ``connections_per_peer``, ``message_bytes``,
    ``connect_timeout`` (s), ``keepalive`` (s); verbs takes ``device`` (RDMA device name), ``port_num``, ``gid_index``,
    ``port`` (TCP port of its connection-exchange listener), ``max_send_wr``, ``max_recv_wr``.
    Raises ``ValueError`` for an unknown name and ``FabricUnavailable`` when the fabric cannot run here.
    """
    return fabric_class(name)(hostname=hostname, **options)
