"""The transfer calls of Mooncake's API (sync, async, with an opcode or a notify, stream-ordered) and the table of
async batches they hand out ids for."""
from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Dict, Optional, Sequence

from integration.codes import (ERR_ENDPOINT, ERR_INVALID_ARGUMENT, ERR_METADATA, TransferNotify, TransferOpcode,
                               count_pieces, error_name, fail, log, parse_opcode)
from integration.cuda import run_in_stream_order
from integration.hosts import normalize_session
from transport.arrays import as_array
from transport.errors import FabricClosed, InvalidTransfer


_CUDA_JOBS = itertools.count(1)   # names the threads of stream-ordered transfers


def read_base_timeout(env: dict) -> Optional[float]:
    """The seconds of Mooncake's timeout rule, from ``MC_TRANSFER_TIMEOUT`` (at least 5, default 30), or None
    when only ``PXN_TIMEOUT`` is set (``env``: the engine's PXN_* settings; the engine's own default applies).
    Read once, at ``initialize``: a small batch's own Python time is its latency, and an environment lookup per
    call is a measurable part of it."""
    mc = os.environ.get("MC_TRANSFER_TIMEOUT")
    if mc is None and "timeout" in env:
        return None  # the engine's own default: its EngineConfig took PXN_TIMEOUT
    try:
        return max(5, int(mc)) if mc is not None else 30
    except ValueError:
        log.warning("MC_TRANSFER_TIMEOUT=%r is not an int; using 30 s", mc)
        return 30


SHORT_COLUMNS = 64
"""Pieces up to which ``nonempty`` gives a flat array's or tensor's lengths back as a list: a dozen entries'
``tolist`` costs less than one numpy reduction, and the zero check here and the byte count of the timeout are
then C loops over a list. Past it, a list's lengths become the int64 array the engine would make of them (one C
pass), so that the zero check and the byte count are numpy reductions and the engine converts nothing again. The
addresses stay as given (the engine takes each column as it comes)."""


def nonempty(buffers, peers, lengths):
    """Drop zero-length pieces (Mooncake accepts them and moves nothing). Returns the three columns as given
    when none is zero-length (keeps the engine's fast path for int64 arrays), the lengths of a short batch (up
    to ``SHORT_COLUMNS`` pieces) as a list and of a longer list as an int64 array: one batch costs about the same
    whatever the type of its columns. A column with a bad entry is passed on as given: the engine names it."""
    try:
        if lengths.__class__ in (list, tuple):
            if len(lengths) > SHORT_COLUMNS:
                lengths = as_array("lengths", lengths)  # raises on a bad entry: the engine names it below
            elif 0 not in lengths:
                return buffers, peers, lengths  # a list without a zero (numpy would find none either): as given
        elif getattr(lengths, "ndim", 0) == 1 and lengths.shape[0] <= SHORT_COLUMNS:
            lengths = lengths.tolist()
            if 0 not in lengths:
                return buffers, peers, lengths
        import numpy as np
        ln = np.asarray(lengths)
        if ln.ndim != 1 or ln.dtype.kind not in "iu" or ln.size == 0 or ln.all():
            return buffers, peers, lengths
        b, p = as_array("buffers", buffers), as_array("peer_buffer_addresses", peers)
        if b.shape != ln.shape or p.shape != ln.shape:
            return buffers, peers, lengths  # the engine names the mismatch
        keep = ln != 0
        return b[keep], p[keep], ln[keep]
    except (TypeError, ValueError, RuntimeError, InvalidTransfer):  # RuntimeError: a tensor not readable here
        return buffers, peers, lengths


class _Pending:
    __slots__ = ("handle", "deadline")

    def __init__(self, handle, deadline: float):
        self.handle = handle
        self.deadline = deadline


class AsyncBatches:
    """Async batches by id (Mooncake's batch ids, >= 1) until their status is read."""

    def __init__(self):
        self._pending: Dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def add(self, handle, deadline: float) -> int:
        """Hold ``handle`` (a ``BatchHandle``) until ``deadline`` (``time.monotonic()`` s); its new id."""
        bid = next(self._ids)
        with self._lock:
            self._pending[bid] = _Pending(handle, deadline)
        return bid

    @staticmethod
    def _finish(bid: int, p: _Pending, wait: Optional[float]) -> int:
        """Wait up to ``wait`` s (None: until the batch's deadline) for a batch; its code."""
        try:
            p.handle.wait(max(0.0, p.deadline - time.monotonic()) if wait is None else wait)
            return 0
        except BaseException as e:  # noqa: BLE001
            return fail(f"batch {bid}", e)

    def wait_all(self, batch_ids: Sequence[int]) -> int:
        """Wait for every listed batch (each until its own deadline), then free the ids. 0 when all succeeded,
        else the code of the first failed batch in list order (ERR_INVALID_ARGUMENT for an unknown id)."""
        first = 0
        for bid in list(batch_ids):
            with self._lock:
                p = self._pending.pop(bid, None)
            if p is None:
                log.warning("get_batch_transfer_status: unknown or already freed batch id %r (%s)", bid,
                            error_name(ERR_INVALID_ARGUMENT))
                code = ERR_INVALID_ARGUMENT
            else:
                code = self._finish(bid, p, None)
            if code and not first:
                first = code
        return first

    def check(self, batch_id: int) -> int:
        """1 done (id freed), 0 in flight, a negative code when it failed or passed its deadline (id freed),
        ERR_INVALID_ARGUMENT for an unknown id."""
        with self._lock:
            p = self._pending.get(batch_id)
        if p is None:
            log.warning("check_batch_transfer_status: unknown or already freed batch id %r", batch_id)
            return ERR_INVALID_ARGUMENT
        if not p.handle.done() and time.monotonic() < p.deadline:
            return 0
        code = self._finish(batch_id, p, 0.0)  # done, or past its deadline: wait(0) names the timeout
        with self._lock:
            self._pending.pop(batch_id, None)
        return 1 if code == 0 else code


class TransferCalls:
    """Mooncake's transfer calls, a mixin of ``integration.mooncake.TransferEngine``: they are the hot path (a
    small batch's Python time is its latency), so each public call reaches the pxn engine through at most one
    shared step, and they read the state ``initialize`` swaps as one: ``_engine`` (the pxn engine or None),
    ``_directory`` (``SegmentDirectory``, None in P2P mode), ``_timeout`` / ``_base_timeout`` (s), ``_batches``
    (``AsyncBatches``), ``_launch_host_func`` (None: ``cudaLaunchHostFunc``) and ``_cuda_failed``."""

    _cuda_failed = 0

    def _eng(self):
        eng = self._engine
        if eng is None:
            raise FabricClosed("the transfer engine is not initialized: call initialize() first")
        return eng

    def _batch_timeout(self, lengths) -> Optional[float]:
        if self._timeout is not None:
            return float(self._timeout)
        base = self._base_timeout
        if base is None:
            return None
        try:
            # builtin sum for lists (a C loop, far cheaper than an int() per item); an array's or tensor's own sum,
            # since builtin sum would make a numpy scalar per entry
            cls = lengths.__class__
            if cls is list or cls is tuple:
                nbytes = sum(lengths)
            else:
                total = getattr(lengths, "sum", None)
                nbytes = int(total() if total is not None else sum(lengths))
        except (TypeError, ValueError, RuntimeError):
            nbytes = 0  # not ints: the engine names the bad entry
        return base + max(nbytes, 0) / 1e9  # Mooncake: MC_TRANSFER_TIMEOUT s + 1 ns per byte

    def _session(self, target) -> str:
        """The pxn session of ``target``: itself ("host:port") in P2P mode, looked up at the metadata server
        otherwise. Raises UnknownSession."""
        directory = self._directory
        return normalize_session(target) if directory is None else directory.resolve(target)

    def _forget(self, target, code: int) -> int:
        """After a failed call: drop the cached session of ``target`` when the failure says the peer is gone,
        so the next call looks it up again (the peer may have restarted elsewhere)."""
        directory = self._directory
        if code in (ERR_METADATA, ERR_ENDPOINT) and isinstance(target, str) and directory is not None:
            directory.forget(target)
        return code

    def _prepare(self, opcode, target, buffers, peers, lengths) -> tuple:
        """What a batch call needs: (opcode, pxn engine, session, buffers, peer addresses, lengths without the
        empty pieces, timeout). Raises what the caller turns into a code."""
        op = parse_opcode(opcode)
        eng = self._eng()
        session = self._session(target)
        b, p, n = nonempty(buffers, peers, lengths)
        return op, eng, session, b, p, n, self._batch_timeout(n)

    def _sync(self, what: str, opcode, target, buffers, peers, lengths, notify=None) -> int:
        """One blocking batch: WRITE local -> peer, READ peer -> local; then the notify, if any."""
        try:
            op, eng, session, b, p, n, timeout = self._prepare(opcode, target, buffers, peers, lengths)
            if op == TransferOpcode.WRITE:
                eng.batch_write(session, b, p, n, timeout=timeout)
            else:
                eng.batch_read(session, b, p, n, timeout=timeout)
            if notify is not None:
                from transport.reads import send_notify
                send_notify(eng, session, getattr(notify, "name", ""), getattr(notify, "msg", ""))
            return 0
        except BaseException as e:  # noqa: BLE001
            return self._forget(target, fail(f"{what} {target!r} ({count_pieces(lengths)} pieces)", e))

    def _async(self, what: str, opcode, target, buffers, peers, lengths) -> int:
        """Submit one batch; its id (>= 1), or 0 when refused at submission (cause logged, nothing written)."""
        try:
            op, eng, session, b, p, n, timeout = self._prepare(opcode, target, buffers, peers, lengths)
            submit = eng.batch_write_async if op == TransferOpcode.WRITE else eng.batch_read_async
            h = submit(session, b, p, n, timeout=timeout)
        except BaseException as e:  # noqa: BLE001
            self._forget(target, fail(f"{what} {target!r} ({count_pieces(lengths)} pieces)", e))
            return 0
        limit = timeout if timeout is not None else eng.default_timeout
        return self._batches.add(h, time.monotonic() + limit)

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """Write ``length`` bytes from local ``buffer`` to ``peer_buffer_address`` at ``target_hostname``.
        Returns 0 once the bytes are at the peer, or a negative code. ``transport_hint`` is accepted for
        signature compatibility and ignored (Mooncake ignores it too outside TENT)."""
        return self._sync("transfer_sync_write to", TransferOpcode.WRITE, target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """Read ``length`` bytes from ``peer_buffer_address`` at ``target_hostname`` into local ``buffer``.
        Returns 0 once the bytes are here, or a negative code (nothing written on a bad address)."""
        return self._sync("transfer_sync_read from", TransferOpcode.READ, target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Write every ``lengths[i]`` bytes from ``buffers[i]`` to ``peer_buffer_addresses[i]`` at the peer.

        Arguments: target_hostname: the peer's session "host:port" (its segment name with a metadata server);
        buffers: local addresses inside registered memory; peer_buffer_addresses: addresses inside memory the
        peer registered; lengths: bytes (zero-length pieces are skipped, as Mooncake).
        Returns 0 when every byte is placed, else a negative code (``integration.mooncake``); on ERR_INVALID_ARGUMENT,
        ERR_ADDRESS_NOT_REGISTERED and ERR_METADATA nothing was written.
        """
        eng = self._engine
        if eng is not None and self._directory is None:
            # P2P mode (sglang's): what ``_sync`` passes to the engine, without its steps for the other calls (a
            # small batch's own Python time is its latency); lists, tuples, arrays and tensors alike
            try:
                b, p, n = nonempty(buffers, peer_buffer_addresses, lengths)
                eng.batch_write(normalize_session(target_hostname), b, p, n, timeout=self._batch_timeout(n))
                return 0
            except BaseException as e:  # noqa: BLE001
                return self._forget(target_hostname, fail(f"batch_transfer_sync_write to {target_hostname!r} "
                                                          f"({count_pieces(lengths)} pieces)", e))
        return self._sync("batch_transfer_sync_write to", TransferOpcode.WRITE, target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        """Read every ``lengths[i]`` bytes from ``peer_buffer_addresses[i]`` at the peer into local
        ``buffers[i]``; the peer gathers small pieces into coalesced chunks (``transport.reads``). Returns 0 or
        a negative code; on ERR_INVALID_ARGUMENT / ERR_ADDRESS_NOT_REGISTERED / ERR_METADATA nothing was
        written."""
        return self._sync("batch_transfer_sync_read from", TransferOpcode.READ, target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        """Submit a batch write and return at once.

        Returns: a batch id >= 1 for ``get_batch_transfer_status`` / ``transfer_check_status``, or 0 when the
        batch was refused at submission (Mooncake's contract); the cause and its code are logged, and nothing
        was written.
        """
        return self._async("batch_transfer_async_write to", TransferOpcode.WRITE, target_hostname, buffers,
                           peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Submit a batch read and return at once: a batch id >= 1, or 0 when refused at submission (a local
        destination outside registered memory, unknown peer...; cause logged). A source outside the peer's
        memory fails the batch at ``get_batch_transfer_status``, with nothing written."""
        return self._async("batch_transfer_async_read from", TransferOpcode.READ, target_hostname, buffers,
                           peer_buffer_addresses, lengths)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, opcode,
                      notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """One piece in the direction of ``opcode`` (``TransferOpcode.Read`` / ``.Write``); with ``notify``
        the peer finds (notify.name, notify.msg) in its ``get_notifies()`` once the bytes are placed.
        Returns 0 or a negative code (ERR_INVALID_ARGUMENT for an unknown opcode)."""
        return self._sync("transfer_sync with", opcode, target_hostname, [buffer], [peer_buffer_address],
                          [length], notify)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode,
                            notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """A batch in the direction of ``opcode``, then ``notify`` (see ``transfer_sync``). 0 or < 0."""
        return self._sync("batch_transfer_sync with", opcode, target_hostname, buffers, peer_buffer_addresses,
                          lengths, notify)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode,
                             transport_hint: str = "") -> int:
        """Submit a batch in the direction of ``opcode``: a batch id >= 1, or 0 when refused (cause logged)."""
        return self._async("batch_transfer_async with", opcode, target_hostname, buffers, peer_buffer_addresses,
                           lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """One-piece ``batch_transfer_async_write``: a batch id >= 1, or 0 when submission failed (Mooncake's
        contract; the cause and its negative code are logged)."""
        return self._async("transfer_submit_write to", TransferOpcode.WRITE, target_hostname, [buffer],
                           [peer_buffer_address], [length])

    # ======================================================================================================
    def transfer_write_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                               stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Write one piece once the work queued on CUDA stream ``stream_ptr`` before this call finished; work
        queued on the stream after it waits for the write. See ``batch_transfer_write_on_cuda``."""
        self._on_cuda(TransferOpcode.WRITE, target_hostname, [buffer], [peer_buffer_address], [length],
                      stream_ptr)

    def transfer_read_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Read one piece in stream order (see ``batch_transfer_write_on_cuda``)."""
        self._on_cuda(TransferOpcode.READ, target_hostname, [buffer], [peer_buffer_address], [length],
                      stream_ptr)

    def batch_transfer_write_on_cuda(self, target_hostname: str, buffers: Sequence[int],
                                     peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                     stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Write a batch in the order of CUDA stream ``stream_ptr`` (a ``cudaStream_t`` as int, 0 = legacy
        default stream): it starts when the stream reaches this point and the stream's later work waits for it,
        as Mooncake's (a host function on the stream).

        Returns None, as Mooncake. Raises RuntimeError at the call, as Mooncake, when the peer is unknown or the
        lists differ in length, and when this process has no CUDA; a failure during the transfer is logged at
        ERROR (Mooncake ends the process there) and counted in ``stats()["cuda_transfers_failed"]``.
        """
        self._on_cuda(TransferOpcode.WRITE, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr)

    def batch_transfer_read_on_cuda(self, target_hostname: str, buffers: Sequence[int],
                                    peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                    stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Read a batch in stream order (see ``batch_transfer_write_on_cuda``)."""
        self._on_cuda(TransferOpcode.READ, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr)


    def _on_cuda(self, opcode, target, buffers, peers, lengths, stream_ptr) -> None:
        try:
            eng = self._eng()
            eng.open_session(self._session(target))  # as Mooncake's openSegment: an unknown peer fails at the call
            b, p, n = list(buffers), list(peers), list(lengths)
            if not (len(b) == len(p) == len(n)):
                raise InvalidTransfer(f"buffers, peer_buffer_addresses and lengths have different sizes "
                                      f"({len(b)}, {len(p)}, {len(n)})")
        except BaseException as e:  # noqa: BLE001
            code = fail(f"*_on_cuda to {target!r}", e)
            raise RuntimeError(f"pxn: stream-ordered transfer to {target!r} refused ({error_name(code)}): {e}") \
                from None
        what = "write to" if opcode == TransferOpcode.WRITE else "read from"

        def job():
            code = self._sync(f"stream-ordered {what}", opcode, target, b, p, n)
            if code:
                log.error("stream-ordered %s %r failed (%s); the stream continues without its data", what,
                          target, error_name(code))
                self._cuda_failed += 1

        run_in_stream_order(stream_ptr, job, f"pxn-on-cuda-{next(_CUDA_JOBS)}", self._launch_host_func)
