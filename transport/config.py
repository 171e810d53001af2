"""The engine's configuration: one frozen ``EngineConfig``, built once from constructor arguments, then the
``PXN_*`` environment variables, then defaults (``EngineConfig.from_env``), and checked as a whole.

Every variable here is operational (what a deployment sets); the README's configuration table lists them. Sizes
take ``65536``, ``64K``, ``1M``, ``8MiB``. A malformed or out-of-range variable raises ``ConfigError`` (a
``ValueError``) naming the variable and its value; an out-of-range argument names the setting.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from transport.errors import ConfigError

__all__ = ["EngineConfig", "parse_size"]


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


def _flag(value) -> bool:
    return str(value).strip().lower() not in ("0", "false", "no", "off", "")


_flag.__name__ = "flag"

# field -> (environment variable, parser of its text)
_ENV = {
    "fabric": ("PXN_FABRIC", str),
    "rails": ("PXN_RAILS", int),
    "coalesce_bytes": ("PXN_COALESCE_BYTES", parse_size),
    "direct_pieces": ("PXN_DIRECT_PIECES", int),
    "relay_slot_bytes": ("PXN_RELAY_SLOT_BYTES", parse_size),
    "relay_slots": ("PXN_RELAY_SLOTS", int),
    "lanes": ("PXN_LANES", int),
    "landing_slots": ("PXN_LANDING_SLOTS", int),
    "stripe_bytes": ("PXN_STRIPE_BYTES", parse_size),
    "relay": ("PXN_RELAY", str),
    "timeout": ("PXN_TIMEOUT", float),
    "trace_path": ("PXN_TRACE", str),
    "switch_interval": ("PXN_SWITCH_INTERVAL", float),
    "loadstore": ("PXN_LOADSTORE", _flag),
    "forward_large": ("PXN_FORWARD_LARGE", _flag),
    "max_senders": ("PXN_MAX_SENDERS", int),
    "handshake_timeout": ("PXN_HANDSHAKE_TIMEOUT", float),
    "max_conns_per_addr": ("PXN_MAX_CONNS_PER_ADDR", int),
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What a ``TransferEngine`` runs with (``transport.engine.TransferEngine`` documents each setting).

    Sizes in bytes, times in seconds."""

    fabric: str = "auto"
    rails: int = 2
    coalesce_bytes: int = 64 << 10
    direct_pieces: int = 0
    relay_slot_bytes: int = 4 << 20
    relay_slots: int = 8
    lanes: int = 2
    landing_slots: int = 16
    stripe_bytes: int = 16 << 20
    relay: str = "auto"
    timeout: float = 120.0
    trace_path: Optional[str] = None
    switch_interval: Optional[float] = None
    loadstore: bool = True
    forward_large: bool = False
    max_senders: int = 256
    handshake_timeout: float = 5.0
    max_conns_per_addr: int = 64

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
                raise ConfigError(f"environment variable {var}={text!r} is not a valid {parse.__name__}") from e
        return values

    def __post_init__(self):
        # normalise the forms constructor arguments may take (sizes as "64K", flags as ints)
        for name in ("coalesce_bytes", "relay_slot_bytes", "stripe_bytes"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        for name in ("loadstore", "forward_large"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    def check(self) -> None:
        """Raise ``ConfigError`` (a ``ValueError``) naming the first setting out of its range."""
        if self.fabric not in ("auto", "tcp", "ipc", "verbs"):
            raise _bad("fabric", f"fabric must be 'auto', 'tcp', 'ipc' or 'verbs', got {self.fabric!r}")
        if self.relay not in ("auto", "always", "never"):
            raise _bad("relay", f"relay must be 'auto', 'always' or 'never', got {self.relay!r}")
        for name, lo in (("rails", 1), ("relay_slots", 1), ("lanes", 1), ("landing_slots", 1),
                         ("relay_slot_bytes", 4096), ("stripe_bytes", 4096), ("coalesce_bytes", 0),
                         ("direct_pieces", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise _bad(name, f"{name} must be an int >= {lo}, got {value!r}")
        if self.landing_slots > 0xFFFF:
            raise _bad("landing_slots", f"landing_slots must be <= 65535 (16 bits of imm), got {self.landing_slots}")
        for name in ("max_senders", "max_conns_per_addr", "handshake_timeout", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not value > 0:
                raise _bad(name, f"{name} must be > 0, got {value!r}")


def _bad(setting: str, message: str) -> ConfigError:
    """A ``ConfigError`` that knows which setting it is about (``from_env`` names the variable behind it)."""
    e = ConfigError(message)
    e.setting = setting
    return e
