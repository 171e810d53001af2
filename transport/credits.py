"""Credits of the receiver's shared landing pools: the ``credits`` control op, the keep-or-return decision at
each ack, grant writes into a sender's credit region, and the credits of dead rails taken back; with the wire
format they share (chunk and ack immediates, the entries of a credit region).

How credits flow (``transport.receiver`` has the whole protocol): a sender holds credits, each naming a slot of
the rail's ``transport.landing.LandingPool``. It asks for more with the ``credits`` op (``CreditDesk.request``);
free slots come in the reply unless others wait, the rest later as grant writes, round-robin (``post_grants``).
At each chunk's ack the credit stays with the sender or goes back to the pool for a waiter (``settle``). The
liveness sweep takes back the credits lent on a rail whose endpoint died (``sweep``).

Wire format: a chunk's immediate is ``chunk_imm`` (credit index, 14-bit sequence number, ``MORE_FLAG``); an ack
or grant is a write into entry ``k`` of the sender's credit region (``ACK_BYTES`` per entry: status and length
or pool slot, then a reason text) with immediate ``ack_imm(k, status)``.
"""
from __future__ import annotations

import logging
import struct
import time
from typing import Tuple

import numpy as np

from transport.fabric.base import WriteRequest

log = logging.getLogger("transport.receiver")  # the receiver's logger: credits are part of receiving

ACK_FLAG = 1 << 31
ACK_BYTES = 256
ST_OK, ST_REJECTED, ST_FAILED, ST_GRANT = 0, 1, 2, 3
F_RETURNED = 0x80  # in an ack's status: the credit went back to the pool (the sender no longer holds it)
F_QUEUED = 0x40  # with F_RETURNED: the sender queues for its next credit (it said it had more chunks)
MORE_FLAG = 1 << 30  # in a chunk's immediate: its sender has more chunks for this rail waiting for credits
ACK_WR_BASE = 1 << 62  # wr_ids of ack writes: the engine's poller ignores their completions unless they fail
# A sender that handshakes again still has its old, dead endpoint here until its new rails connect; the sweep
# gives it this long to connect before it counts as departed (rails connect one after the other, each within the
# fabric's connect timeout, 10 s on tcp).
CONNECT_GRACE_S = 30.0
# A credit is a lease: lent (or kept at an ack) and not written within this many seconds while other senders wait
# for the pool, it is taken back with every credit of its sender on that rail, by aborting the rail's endpoint to
# that sender (``CreditDesk.sweep``): a sender that stalls (stopped, swapped out) holding slots cannot keep the
# others waiting. Only a broken connection guarantees that a late write cannot land in a slot lent to someone
# else since (an RDMA write needs no receiver work). The sender's rail fails over, and it asks for credits again.
LEASE_S = 2.0
_ACK_HDR = struct.Struct("<II")  # status, reason length


def chunk_imm(slot: int, seq: int, more: bool = False) -> int:
    """A chunk's immediate: credit index ``slot``, sequence number (14 bits), ``MORE_FLAG``."""
    return ((seq & 0x3FFF) << 16) | (slot & 0xFFFF) | (MORE_FLAG if more else 0)


def ack_imm(slot: int, status: int) -> int:
    return ACK_FLAG | ((status & 0xFF) << 16) | (slot & 0xFFFF)


def decode_ack(imm: int) -> Tuple[int, int]:
    """(credit index, status with its flags) of an ack immediate."""
    return imm & 0xFFFF, (imm >> 16) & 0xFF


def decode_grant(buf: np.ndarray) -> int:
    """The pool slot of a grant written at ``buf`` (an ack entry of the credit region)."""
    return int(_ACK_HDR.unpack(buf[:8].tobytes())[1])


def decode_ack_payload(buf: np.ndarray) -> str:
    status, n = _ACK_HDR.unpack(buf[:8].tobytes())
    n = min(int(n), ACK_BYTES - 8)
    return buf[8:8 + n].tobytes().decode("utf-8", "replace")


def int_field(hello: dict, key: str, lo: int, hi: int, default=None) -> int:
    """``hello[key]`` as an int in [lo, hi] (bools and other types refused); ``default`` when absent."""
    v = hello.get(key, default)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"sender {key}={v!r}: need an int in [{lo}, {hi}]")
    return v


class CreditDesk:
    """The credits of one receiver's landing pools (see the module docstring).

    Arguments: fabrics: the engine's rail fabrics (grant and ack writes go out on them); lock: the receiver's
    lock, which guards ``senders`` and every sender's credit state; senders: the receiver's connected senders
    (engine id -> ``transport.receiver.SenderState``, shared, changed under ``lock``); counters: the engine's
    counters."""

    def __init__(self, fabrics, lock, senders: dict, counters):
        self.fabrics = fabrics
        self._lock = lock
        self._senders = senders
        self.counters = counters

    def request(self, req: dict) -> dict:
        """The ``credits`` control op of a connected sender: ``release`` (credit indices it returns unused) and
        ``want`` (credits it asks for) on ``rail``. Free slots are lent at once unless others wait (the reply's
        ``grants``: [[credit index, pool slot]]); the rest come later as grant writes, round-robin."""
        engine_id = int_field(req, "engine_id", 1, (1 << 63) - 1)
        rail = int_field(req, "rail", 0, len(self.fabrics) - 1)
        want = int_field(req, "want", 0, 0xFFFF, 0)
        release = req.get("release") or []
        if not (isinstance(release, list) and len(release) <= 0xFFFF and all(type(k) is int for k in release)):
            raise ValueError(f"credits release {str(release)[:200]}: need a list of credit indices")
        with self._lock:
            st = self._senders.get(engine_id)
            if st is None or st.retired:
                raise ValueError(f"credits: engine 0x{engine_id:x} is not a connected sender")
            pool = st.pools[rail]
            for k in release:
                if k in st.lent[rail]:
                    pool.take_back(st, k)
            mine = []
            st.want[rail] = min(want, st.slots - len(st.lent[rail]))
            if st.want[rail] > 0:
                if not pool.waiters:
                    while st.want[rail] > 0:
                        got = pool.lend(st)
                        if got is None:
                            break
                        mine.append(list(got))
                        st.want[rail] -= 1
                if st.want[rail] > 0:
                    pool.enqueue(st)
            later = []
            for g in pool.dispatch():
                if g[0] is st:
                    mine.append([g[2], g[3]])
                else:
                    later.append(g)
            queued = st.queued[rail]
        self.counters.add_many((("rx_credit_requests", 1), ("rx_credits_released", len(release))))
        self.post_grants(later)
        return {"ok": True, "grants": mine, "queued": queued}

    def settle(self, st, rail: int, k: int, more: bool) -> Tuple[int, list]:
        """At the ack of the chunk in credit ``k``: whether the sender keeps it (flags 0) or it goes back to the
        pool (``F_RETURNED``, with ``F_QUEUED`` when the sender waits for its next one), and the grants that
        frees for waiting senders."""
        with self._lock:
            pool = st.pools[rail]
            if st.retired or k not in st.lent[rail]:
                return 0, []
            # kept while nobody waits (unused credits come back within the sender's CREDIT_IDLE_S), or while it has
            # more to send and holds less than its share (this credit counted)
            if not pool.waiters or (more and len(st.lent[rail]) < pool.share()):
                st.leased[rail][k] = time.monotonic()  # kept: a new lease
                return 0, []
            pool.take_back(st, k)
            st.returning[rail].add(k)
            flags = F_RETURNED
            if more:  # behind the senders already waiting
                st.want[rail] = max(st.want[rail], 1)
                pool.enqueue(st)
                flags |= F_QUEUED
            grants = pool.dispatch()
            return flags, grants

    def post_grants(self, grants) -> None:
        """Tell each sender of ``grants`` its new credit (a grant write into its credit region). A grant that
        cannot be written goes back to the pool; its sender asks again when it waits too long."""
        if grants:
            self.counters.add("rx_grants", len(grants))
        while grants:
            failed = [g for g in grants if not self.write(g[0], g[1], g[2], ST_GRANT, "", g[3])]
            grants = []
            if failed:
                self.counters.add("rx_grants_failed", len(failed))
                with self._lock:
                    for st, rail, k, p in failed:
                        if st.lent[rail].get(k) == p:
                            st.pools[rail].take_back(st, k)
                        st.want[rail] = 0  # not queued again: a sender we cannot write to asks again itself
                    pools = {id(st.pools[rail]): st.pools[rail] for st, rail, _, _ in failed}
                    for pool in pools.values():
                        grants.extend(g for g in pool.dispatch() if g not in failed)

    def sweep(self) -> None:
        """Credits lent on a rail whose endpoint to their sender died go back to the pool (the sender's other
        rails keep theirs). A sender holding a credit whose lease ran out (``LEASE_S``) while others wait for that
        pool loses the rail: its endpoint is aborted and its credits there go back."""
        grants = []
        now = time.monotonic()
        expired = []
        with self._lock:
            for st in list(self._senders.values()):
                for rail, fab in enumerate(self.fabrics):
                    if not st.lent[rail] and not st.queued[rail]:
                        continue
                    try:
                        ep = fab.endpoint(st.rail_ids[rail])
                    except Exception:  # noqa: BLE001 — not connected yet
                        continue
                    leased = st.leased[rail]
                    if ep.alive and leased and st.pools[rail].waiters and now - min(leased.values()) > LEASE_S:
                        expired.append((st, rail, ep, len(st.lent[rail]), len(st.pools[rail].waiters)))
                        continue
                    if ep.alive or (ep is st.stale_eps.get(rail) and now - st.hello_at < CONNECT_GRACE_S):
                        continue
                    n = len(st.lent[rail])
                    st.pools[rail].forget(st)
                    self.counters.add("rx_credits_reclaimed", n)
                    grants.extend(st.pools[rail].dispatch())
        self.post_grants(grants)
        grants = []
        for st, rail, ep, n, waiting in expired:
            self.counters.add("rx_leases_expired")
            log.warning("receiver: sender %s holds %d credit(s) on rail %d, one unwritten for more than %.1f s, "
                        "while %d sender(s) wait: aborting that rail to it, its credits go back to the pool",
                        st.session, n, rail, LEASE_S, waiting)
            try:
                ep.abort()  # nothing more of it lands: its slots can go to others
            except Exception:  # noqa: BLE001 — closing already
                pass
            with self._lock:
                if not st.retired:
                    n = len(st.lent[rail])
                    st.pools[rail].forget(st)
                    self.counters.add("rx_credits_reclaimed", n)
                    grants.extend(st.pools[rail].dispatch())
        self.post_grants(grants)

    def write(self, st, rail: int, k: int, status: int, reason: str, value: int = 0) -> bool:
        """One write into entry ``k`` of the sender's credit region on ``rail``: imm = ACK | status << 16 | k;
        payload: status and the reason's length (a grant: the pool slot) and the reason text. False when the
        write could not be posted."""
        if st.retired:
            return False
        ack_buf, ack_mr = st.acks[rail]
        off = k * ACK_BYTES
        data = reason.encode("utf-8")[:ACK_BYTES - 8]
        _ACK_HDR.pack_into(ack_buf.array, off, status, value if status == ST_GRANT else len(data))
        if data:
            ack_buf.array[off + 8:off + 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        length = 8 + len(data)
        remote = st.credit_addr + (rail * st.slots + k) * ACK_BYTES
        fab = self.fabrics[rail]
        # unacked where the fabric can: nothing here waits for the ack write's completion (its loss shows at the
        # sender, whose chunk then never completes), and its own acknowledgement would cost a message each way
        unacked = fab.capabilities.unacked_writes
        try:
            ep = fab.endpoint(st.rail_ids[rail])
            fab.post_writes(ep, [WriteRequest(ack_buf.addr + off, length, remote, st.credit_rkeys[rail],
                                              ack_mr.lkey, imm=ack_imm(k, status),
                                              wr_id=ACK_WR_BASE + k, signaled=not unacked, acked=not unacked)])
        except Exception as e:  # noqa: BLE001 — the sender fails over when the rail is dead
            self.counters.add("rx_ack_failed")
            log.info("receiver: credit write (status 0x%x) for credit %d on rail %d to %s failed: %s", status, k,
                     rail, st.session, e)
            return False
        return True
