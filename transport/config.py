"""The engine's configuration: one frozen ``EngineConfig``, built once from constructor arguments, then the
``PXN_*`` environment variables, then defaults (``EngineConfig.from_env``), and checked as a whole.

Every ``PXN_*`` variable an engine or its parts read is a field here, marked operational (what a deployment sets:
fabric, rails, secrets, timeouts) or tuning (one cost against another, with measured defaults); the README's
configuration table lists them. Parts that run without an engine read theirs through ``EngineConfig.read``. Sizes
take ``65536``, ``64K``, ``1M``, ``8MiB``. A malformed or out-of-range variable raises ``ConfigError`` (a
``ValueError``) naming the variable and its value; an out-of-range argument names the setting.

Three variables are not fields, because no engine reads them (``OTHER_VARIABLES`` lists them too):

* ``PXN_KERNEL_POLICY`` is read by ``pxn_kernels.policy`` at the first kernel launch: a launch-policy file from a
  sweep. The kernels are the layer below ``transport`` and run without an engine, so they cannot import this module.
* ``PXN_SGLANG_PLUGIN`` is read by ``integration.sglang.register_sglang_plugin`` (through ``parse_flag``) when sglang
  loads its plugins, before any engine exists: whether pxn patches sglang at all.
* ``PXN_SHAPES`` is read by ``pxn bench`` (``transport.bench_cli.shapes_path``): the CLI's input file, beside
  ``--shapes``; an engine never sees it.
"""
from __future__ import annotations

import dataclasses
import os
import stat
from typing import Dict, Mapping, Optional, Tuple

from transport.errors import ConfigError

__all__ = ["EngineConfig", "OPERATIONAL", "TUNING", "OTHER_VARIABLES", "parse_size", "parse_flag", "unwritable",
           "MAX_RAILS"]

OTHER_VARIABLES = {
    "PXN_KERNEL_POLICY": "pxn_kernels.policy: the kernels' launch-policy file, read at the first launch, below "
                         "transport and without an engine",
    "PXN_SGLANG_PLUGIN": "integration.sglang: whether the sglang plugin patches sglang, read before any engine exists",
    "PXN_SHAPES": "transport.bench_cli: pxn bench's shapes file (beside --shapes), never an engine's",
}
"""The ``PXN_*`` variables the library reads that are not ``EngineConfig`` fields: variable -> where it is read
and why it is no engine setting."""

MAX_RAILS = 64
"""Most rails one engine runs: each holds sockets, threads, a landing pool (``landing_bytes``) and relay rings,
so a thousand took tens of GB; machines have up to 32 NIC ports."""
_MOST = {"relay_slot_bytes": 1 << 30, "landing_bytes": 64 << 30, "relay_slots": 1024, "lanes": 64}
"""Upper bounds of settings that size memory: a typo (``PXN_LANDING_BYTES=32G`` for 32M) must be refused by
name, not end in the kernel's out-of-memory killer."""

_PSEUDO_FILE_SYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs",
                        "devpts", "pstore", "bpf", "efivarfs", "fusectl", "mqueue", "hugetlbfs"}


def _file_system_of(path: str) -> Optional[Tuple[str, str]]:
    """(mount point, file system type) of the mount holding ``path``, from /proc/self/mountinfo; None when it
    cannot be read (not Linux)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            mounts = []
            for line in f:
                fields = line.split()
                mount_point = fields[4].replace("\\040", " ")
                fs_type = fields[fields.index("-") + 1]
                mounts.append((mount_point, fs_type))
    except (OSError, ValueError, IndexError):
        return None
    best = None
    for mount_point, fs_type in mounts:  # the last, longest mount point wins: it is the one on top
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, fs_type)
    return best


def unwritable(path: str) -> Optional[str]:
    """Why a results file cannot be written at ``path``, or None when it can: its folder exists and takes a new
    file (tried: an empty file is made and removed), an existing file is a regular one that may be written, and
    neither lies in a kernel file system (/proc, /sys). Checked before work starts, so a run's results are not
    lost at its end."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return "it is a directory"
    parent = os.path.dirname(path)
    if not os.path.exists(parent):
        return f"folder {parent} does not exist"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    mount = _file_system_of(os.path.realpath(parent))
    if mount is not None and mount[1] in _PSEUDO_FILE_SYSTEMS:
        return f"{mount[0]} is the kernel's {mount[1]} file system, not storage"
    if os.path.exists(path):
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "it is not a regular file"
        return None if os.access(path, os.W_OK) else "the file is not writable"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        return f"cannot create a file there ({e.strerror or e})"
    os.close(fd)
    os.unlink(path)
    return None


def parse_size(value) -> int:
    """Parse sizes like ``65536``, ``64K``, ``1M``, ``8MiB`` (bytes). Raises ``ValueError`` for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is not a number of bytes")
    if isinstance(value, int):
        return value
    s = str(value).strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


parse_size.__name__ = "size"


FLAG_TRUE, FLAG_FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(value) -> bool:
    """A boolean variable's value: one of ``FLAG_TRUE`` / ``FLAG_FALSE`` (any case). Anything else is refused, not
    read as either: a typo in ``PXN_INSECURE`` must not turn authentication off."""
    text = str(value).strip().lower()
    if text in FLAG_TRUE:
        return True
    if text in FLAG_FALSE:
        return False
    raise ValueError(f"{value!r} is not a flag")


_flag.__name__ = "flag (1, true, yes, on or 0, false, no, off)"


def parse_flag(variable: str, default: bool, environ: Optional[Mapping[str, str]] = None) -> bool:
    """A boolean ``PXN_*`` variable that is not an engine setting (the sglang plugin's switch): ``default`` when
    unset or empty, else its value; ``ConfigError`` naming the variable and the value for anything else."""
    text = (os.environ if environ is None else environ).get(variable)
    if text is None or text.strip() == "":
        return default
    try:
        return _flag(text)
    except ValueError:
        raise ConfigError(f"environment variable {variable}={text!r} is not a valid {_flag.__name__}") from None


def _seconds_from_us(value) -> float:
    v = float(value) / 1e6
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{value!r} is not microseconds in [0, 1000000]")
    return v


_seconds_from_us.__name__ = "number of microseconds in [0, 1000000]"


def _gid_index(value) -> int:
    v = int(value)
    if v < 0:
        raise ValueError(f"{value!r} is negative")
    return v


_gid_index.__name__ = "GID table index (an int >= 0)"

OPERATIONAL, TUNING = "operational", "tuning"


def _setting(default, variable: str, kind: str, parse=str, **field_options):
    """A field of ``EngineConfig`` read from ``variable`` (parsed by ``parse``); ``kind`` says whether a deployment
    sets it (operational) or it trades one cost against another (tuning)."""
    return dataclasses.field(default=default, metadata={"env": variable, "kind": kind, "parse": parse},
                             **field_options)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What a ``TransferEngine`` and its fabrics run with: every ``PXN_*`` variable of an engine, one field each
    (``transport.engine.TransferEngine`` documents the engine's settings; ``EngineConfig.variables()`` lists them
    with their kind). Sizes in bytes, times in seconds."""

    # --- operational: what a deployment sets ---
    fabric: str = _setting("auto", "PXN_FABRIC", OPERATIONAL)
    rails: int = _setting(2, "PXN_RAILS", OPERATIONAL, int)
    relay: str = _setting("auto", "PXN_RELAY", OPERATIONAL)
    timeout: float = _setting(120.0, "PXN_TIMEOUT", OPERATIONAL, float)
    trace_path: Optional[str] = _setting(None, "PXN_TRACE", OPERATIONAL)
    max_senders: int = _setting(256, "PXN_MAX_SENDERS", OPERATIONAL, int)
    handshake_timeout: float = _setting(5.0, "PXN_HANDSHAKE_TIMEOUT", OPERATIONAL, float)
    max_conns_per_addr: int = _setting(64, "PXN_MAX_CONNS_PER_ADDR", OPERATIONAL, int)
    max_pending: int = _setting(128, "PXN_MAX_PENDING", OPERATIONAL, int)
    """Control port: connections still authenticating, in all; a new one beyond drops the oldest waiting."""
    max_pending_per_addr: int = _setting(32, "PXN_MAX_PENDING_PER_ADDR", OPERATIONAL, int)
    """Control port: the same, per source address."""
    secret: Optional[str] = _setting(None, "PXN_SECRET", OPERATIONAL, repr=False, compare=False)
    """The shared secret (``transport.auth.resolve_secret`` applies its rules); never in a repr."""
    secret_file: Optional[str] = _setting(None, "PXN_SECRET_FILE", OPERATIONAL)
    insecure: bool = _setting(False, "PXN_INSECURE", OPERATIONAL, _flag)
    gid_index: Optional[int] = _setting(None, "PXN_GID_INDEX", OPERATIONAL, _gid_index)
    metadata_ttl: float = _setting(5.0, "PXN_METADATA_TTL", OPERATIONAL, float)
    """Mooncake API on etcd: seconds of the lease on an engine's entry."""
    landing_bytes: int = _setting(32 << 20, "PXN_LANDING_BYTES", OPERATIONAL, parse_size)
    """Bytes of the landing pool per receiving rail, shared by every sender (the receiver's memory budget)."""
    # --- tuning: one cost against another; the defaults are measured ---
    coalesce_bytes: int = _setting(64 << 10, "PXN_COALESCE_BYTES", TUNING, parse_size)
    direct_pieces: int = _setting(0, "PXN_DIRECT_PIECES", TUNING, int)
    relay_slot_bytes: int = _setting(4 << 20, "PXN_RELAY_SLOT_BYTES", TUNING, parse_size)
    relay_slots: int = _setting(8, "PXN_RELAY_SLOTS", TUNING, int)
    lanes: int = _setting(2, "PXN_LANES", TUNING, int)
    landing_slots: int = _setting(16, "PXN_LANDING_SLOTS", TUNING, int)
    stripe_bytes: int = _setting(16 << 20, "PXN_STRIPE_BYTES", TUNING, parse_size)
    switch_interval: Optional[float] = _setting(None, "PXN_SWITCH_INTERVAL", TUNING, float)
    loadstore: bool = _setting(True, "PXN_LOADSTORE", TUNING, _flag)
    forward_large: bool = _setting(False, "PXN_FORWARD_LARGE", TUNING, _flag)
    ack_spin: Optional[float] = _setting(None, "PXN_ACK_SPIN_US", TUNING, _seconds_from_us)
    """tcp: seconds a caller waiting for a small batch's ack reads its socket before it sleeps (the variable is
    in microseconds); None: the fabric's default."""
    recv_spin: Optional[float] = _setting(None, "PXN_RECV_SPIN_US", TUNING, _seconds_from_us)
    """tcp: the same for a receive thread waiting for the next small batch."""

    @staticmethod
    def variables() -> Dict[str, Tuple[str, str]]:
        """Field name -> (``PXN_*`` variable, kind: ``"operational"`` or ``"tuning"``), in declaration order."""
        return {f.name: (f.metadata["env"], f.metadata["kind"]) for f in dataclasses.fields(EngineConfig)}

    @classmethod
    def read(cls, names, environ: Optional[Mapping[str, str]] = None) -> dict:
        """The settings ``names`` from their variables in ``environ`` (default ``os.environ``), parsed, for the
        parts that run without an engine (a fabric built alone, the metadata server, the Mooncake layer): only
        those set and not empty. A malformed value raises ``ConfigError`` naming the variable and its value."""
        return cls.environment(environ, skip=set(_ENV) - set(names))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, defaults: Optional[Mapping] = None,
                 **given) -> "EngineConfig":
        """Each field from ``given`` (a constructor argument; None means not given), else its ``PXN_*`` variable
        in ``environ`` (default ``os.environ``), else ``defaults`` (a fabric's own defaults,
        ``Fabric.config_defaults``), else the class default; then the whole is checked."""
        unknown = sorted((set(given) | set(defaults or ())) - set(_ENV))
        if unknown:
            raise TypeError(f"EngineConfig: unknown setting(s) {unknown}")
        given = {name: value for name, value in given.items() if value is not None}
        values = dict(defaults or {})
        values.update(cls.environment(environ, skip=given))  # a variable under a given argument is not read
        values.update(given)
        try:
            cfg = cls(**values)
            cfg.check()
        except ConfigError as e:
            var = _ENV.get(getattr(e, "setting", None), (None,))[0]
            env = os.environ if environ is None else environ
            if var is not None and e.setting not in given and env.get(var):
                # the bad value came from the environment: say which variable, as a user sets it
                raise ConfigError(f"environment variable {var}={env[var]!r}: {e}") from None
            raise
        return cfg

    @staticmethod
    def environment(environ: Optional[Mapping[str, str]] = None, skip=()) -> dict:
        """The settings the ``PXN_*`` variables of ``environ`` (default ``os.environ``) give, parsed: only those
        set and not empty (the Mooncake layer needs to know which ones a deployment set), except the settings
        named in ``skip``. A malformed value raises ``ValueError`` naming the variable and its value."""
        env = os.environ if environ is None else environ
        values = {}
        for name, (var, parse) in _ENV.items():
            if name in skip:
                continue
            text = env.get(var)
            if text is None or text == "":
                continue
            try:
                values[name] = parse(text)
            except ValueError as e:
                raise ConfigError(f"environment variable {var}={text!r}: not a valid {parse.__name__}") from e
        return values

    def __post_init__(self):
        # normalise the forms constructor arguments may take (sizes as "64K", flags as ints)
        for name in ("coalesce_bytes", "relay_slot_bytes", "stripe_bytes", "landing_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        for name in ("loadstore", "forward_large", "insecure"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    def check(self) -> None:
        """Raise ``ConfigError`` (a ``ValueError``) naming the first setting out of its range."""
        self._check_names()
        self._check_counts()
        self._check_times()
        self._check_ids()

    def _check_names(self) -> None:
        """The settings that name one of a set: ``fabric`` one of ``transport.fabric.FABRICS`` (built-in,
        registered or by entry point) or "auto"; ``relay``."""
        if self.fabric != "auto":
            from transport.fabric import FABRICS
            if not isinstance(self.fabric, str) or self.fabric not in FABRICS:
                names = ", ".join(repr(n) for n in ("auto", *FABRICS))
                raise _bad("fabric", f"fabric must be one of {names}, got {self.fabric!r}")
        if self.relay not in ("auto", "always", "never"):
            raise _bad("relay", f"relay must be 'auto', 'always' or 'never', got {self.relay!r}")

    def _check_counts(self) -> None:
        """Counts and sizes: ints at least their least value and at most their most (``MAX_RAILS``, ``_MOST``,
        16 bits of landing slots)."""
        for name, lo in (("rails", 1), ("relay_slots", 1), ("lanes", 1), ("landing_slots", 1),
                         ("relay_slot_bytes", 4096), ("stripe_bytes", 4096), ("coalesce_bytes", 0),
                         ("landing_bytes", 4096), ("direct_pieces", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise _bad(name, f"{name} must be an int >= {lo}, got {value!r}")
        if self.rails > MAX_RAILS:
            raise _bad("rails", f"rails must be at most {MAX_RAILS}, got {self.rails}")
        for name, most in _MOST.items():
            if getattr(self, name) > most:
                raise _bad(name, f"{name} must be at most {most}, got {getattr(self, name)}")
        if self.landing_slots > 0xFFFF:
            raise _bad("landing_slots", f"landing_slots must be <= 65535 (16 bits of imm), got {self.landing_slots}")
        for name in ("max_senders", "max_conns_per_addr", "max_pending", "max_pending_per_addr"):
            _positive(name, getattr(self, name))

    def _check_times(self) -> None:
        """Seconds: the GIL switch interval in (0, 1], the spins in [0, 1], the timeouts above 0."""
        if self.switch_interval is not None and (isinstance(self.switch_interval, bool)
                                                 or not 0.0 < self.switch_interval <= 1.0):
            raise _bad("switch_interval", f"switch_interval must be None or seconds in (0, 1], "
                                          f"got {self.switch_interval!r}")
        for name in ("ack_spin", "recv_spin"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not 0.0 <= value <= 1.0):
                raise _bad(name, f"{name} must be None or seconds in [0, 1], got {value!r}")
        for name in ("handshake_timeout", "timeout", "metadata_ttl"):
            _positive(name, getattr(self, name))

    def _check_ids(self) -> None:
        """What names a place: the trace file must be writable, the GID index an int >= 0."""
        if self.trace_path:
            why = unwritable(self.trace_path)
            if why:
                raise _bad("trace_path", f"trace_path {self.trace_path}: cannot write a trace there: {why}")
        if self.gid_index is not None and (isinstance(self.gid_index, bool) or not isinstance(self.gid_index, int)
                                           or self.gid_index < 0):
            raise _bad("gid_index", f"gid_index must be None or an int >= 0, got {self.gid_index!r}")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not value > 0:
        raise _bad(name, f"{name} must be > 0, got {value!r}")


def _bad(setting: str, message: str) -> ConfigError:
    """A ``ConfigError`` that knows which setting it is about (``from_env`` names the variable behind it)."""
    e = ConfigError(message)
    e.setting = setting
    return e


# field -> (environment variable, parser of its text)
_ENV = {f.name: (f.metadata["env"], f.metadata["parse"]) for f in dataclasses.fields(EngineConfig)}
