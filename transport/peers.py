"""Peers, rails and failover: who this engine is connected to, over which rails, and what happens when a rail
fails.

* ``PeerRail``: one rail to one peer (endpoint, the landing credits it holds at the peer, attempts in flight);
* ``Peer``: one incarnation of a connection to a session, made at the handshake, forgotten when every rail failed;
* ``PeerDirectory``: the sessions this engine is connected to, the rails by the peer's rail id (for acks), why a
  session was last forgotten, and the usable rails for data on a device (``rail_choices``);
* ``Failover``: a rail that fails has its unfinished attempts re-dispatched on the device's other rails; a batch
  fails only when every rail failed; a peer without a live rail is forgotten, and the next batch to its session
  handshakes again.

The directory's lock is the data path's lock (attempt state and peers change together in ``Failover``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from transport.errors import FabricError, PeerGone, PeerLost, TransferError
from transport.fabric.base import DEVICE_HOST
from transport.planner import COALESCED, DIRECT, RELAYED, RailChoice, Unit
from transport.regions import RegionTable

if TYPE_CHECKING:  # annotations only
    from transport.packing import HostBuffer

log = logging.getLogger("transport.engine")  # one logger for the engine and its parts

REDISPATCH_WAITS = 3
"""How often a unit with no rail left waits for a dead rail's queued completions before that rail is failed as
"endpoint died" (each wait lasts until the completions queued in the progress loop by then are handled)."""


class PeerRail:
    """This engine's view of one rail to one peer: endpoint, landing-slot credits, work in flight."""

    def __init__(self, rail: int, ep, remote_id: str, landing_addr: int, landing_rkey: int, slots: int,
                 slot_bytes: int, peer: Optional["Peer"] = None):
        self.rail = rail
        self.peer = peer  # the peer incarnation this rail belongs to (the one to forget when every rail is dead)
        self.ep = ep
        self.remote_id = remote_id
        self.landing_addr = landing_addr  # the peer's landing pool on this rail
        self.landing_rkey = landing_rkey
        self.slots = slots  # credits this engine may hold here (entries of its credit region per rail)
        self.slot_bytes = slot_bytes  # largest chunk the peer takes
        self.stride = slot_bytes  # bytes between two pool slots (the hello's landing_stride)
        self.credit_slot: Dict[int, int] = {}  # credits held: credit index -> pool slot
        self.free_landing: List[int] = []  # credits held and not in use
        self.landing_owner: Dict[int, object] = {}  # credit -> the attempt (a chunk) holding it
        self.chunk_demand = 0  # chunks dispatched to this rail that hold no credit yet
        self.asked_at = 0.0  # time.monotonic() of the last ask for credits (or of being queued by an ack)
        self.grants_in = 0  # grants received: tells a "queued" reply from one a grant already overtook
        self.idle_since = 0.0  # time.monotonic() when the last chunk took a credit
        self.cv = threading.Condition()
        self.inflight: set = set()
        self.alive = True
        self.cause: Optional[BaseException] = None
        self.bytes_in_flight = 0

    def usable(self) -> bool:
        return self.alive and self.ep.alive

    def grant(self, grants) -> None:
        """Credits granted by the peer: (credit index, pool slot) pairs, now free to use. A grant answers an ask:
        once out of credits again, the rail may ask at once."""
        with self.cv:
            if grants:
                self.asked_at = 0.0
                self.grants_in += 1
            for k, p in grants:
                if 0 <= k < self.slots and k not in self.credit_slot:
                    self.credit_slot[k] = p
                    self.free_landing.append(k)
            self.cv.notify_all()

    def release_landing(self, slot: int, a=None) -> None:
        """Credit ``slot`` of attempt ``a`` is free again (unless the peer took it back meanwhile)."""
        with self.cv:
            owner = self.landing_owner.get(slot)
            if owner is not None and (a is None or owner is a):
                del self.landing_owner[slot]
                if slot in self.credit_slot:
                    self.free_landing.append(slot)
            self.cv.notify()


class Peer:
    """One incarnation of a connection to a session: made at the handshake, forgotten (``retired``) when every
    rail failed. A later batch to the same session builds a new ``Peer``; batches still holding this one fail
    with its rails' causes."""

    def __init__(self, session: str):
        self.session = session
        self.lock = threading.Lock()  # handshake and control socket
        self.ready = False
        self.retired = False
        self.lost_work = False  # a rail failed with work in flight (the forget is then worth a warning)
        self.error: Optional[BaseException] = None  # why its handshake failed (shared with callers that waited)
        self.engine_id = 0
        self.claim_key: Optional[bytes] = None  # the peer's key for this engine (hello reply's ``sender_key``)
        self.chunk_key: Optional[bytes] = None  # the MAC key of chunks to the peer (``transport.auth.chunk_key``)
        # the control socket the peer knows this engine on (its hello's, or one a credits request was answered
        # on): requests there carry no proof of ``claim_key``
        self.proven_ctrl: Optional[socket.socket] = None
        self.rails: List[PeerRail] = []
        self.regions = RegionTable()
        self.ctrl: Optional[socket.socket] = None
        self.credit: Optional["HostBuffer"] = None
        self.credit_mrs: List = []
        self.seq = itertools.count(1)
        self.landing_device = DEVICE_HOST
        self.forward: Optional[Dict[int, int]] = None  # rail -> the peer's landing GPU, where it forwards
        self.loadstore = None  # rail 0's local writer for a same-host peer (the ipc fabric's load/store path)
        # the planner of every route to this peer: the engine's, or its own when the peer's landing slots take
        # smaller chunks than ours (one planner per peer, so that its routes share one tie rotation)
        self.planner = None

    def connected(self) -> bool:
        # a plain loop: called twice per batch, where any(<genexpr>) costs a generator
        for pr in self.rails:
            if pr.alive and pr.ep.alive:
                return True
        return False


def close_ctrl_locked(peer: Peer) -> None:
    """Close the peer's control socket (``peer.lock`` held, or the peer forgotten)."""
    sock, peer.ctrl = peer.ctrl, None
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


def rail_local_gpus(routes, rail_keys: List[str]) -> List[Optional[int]]:
    """Per rail (NIC port key): the GPU whose direct rail it is, i.e. the GPU next to that NIC, or None."""
    local: Dict[str, int] = {}
    for g in routes.gpus:
        for r in routes.rails(g):
            if r.relay_gpu == g and r.kind == "direct":
                local.setdefault(r.key, g)
    return [local.get(k) for k in rail_keys]


class PeerDirectory:
    """The sessions this engine is connected to (``peers``), each peer rail by the peer's rail id
    (``by_remote_rail``, where acks come from), and why a session was last forgotten (``lost``, for error
    messages). ``lock`` guards all three (and, shared with the data path, the attempts on the rails).

    Arguments: lock: the data path's lock; routes: ``transport.routing`` routes of the topology, or None (every
    rail is local to every device); rail_keys: the NIC port key of each rail."""

    make_peer = Peer
    make_rail = PeerRail

    def __init__(self, lock, routes=None, rail_keys: Optional[List[str]] = None):
        self.lock = lock
        self.routes = routes
        self.rail_keys = list(rail_keys or [])
        self.peers: Dict[str, Peer] = {}
        self.by_remote_rail: Dict[str, Tuple[Peer, PeerRail]] = {}
        self.lost: Dict[str, str] = {}
        # per session, the key its engine gave this one at the last hello (kept after a forget: the next hello
        # proves with it that this engine is the sender the peer may still hold; ``transport.control``)
        self.claim_keys: Dict[str, bytes] = {}

    def __getitem__(self, session: str) -> Peer:
        return self.peers[session]

    def get(self, session: str) -> Optional[Peer]:
        return self.peers.get(session)

    def values(self) -> List[Peer]:
        """The peers, as a list (a snapshot: handshakes and failovers change the directory)."""
        return list(self.peers.values())

    def rail_choices(self, device: int, peer: Peer) -> List[RailChoice]:
        """Usable rails for data on ``device`` to ``peer``, best first."""
        out = []
        if self.routes is not None and device >= 0:
            keys = self.rail_keys
            for r in self.routes.rails(device):
                idx = keys.index(r.key) if r.key in keys else -1
                if idx >= 0 and peer.rails[idx].usable():
                    out.append(rail_choice(idx, r.relay_gpu == device, r.relay_gpu))
            return out
        for i, pr in enumerate(peer.rails):
            if pr.usable():
                out.append(rail_choice(i, True, device))
        return out

    def close(self) -> None:
        """Close what the peers hold locally (load/store writers, control sockets)."""
        for peer in list(self.peers.values()):
            if peer.loadstore is not None:
                peer.loadstore.close()
            if peer.ctrl is not None:
                try:
                    peer.ctrl.close()
                except OSError:
                    pass


RAIL_CHOICES: Dict[tuple, RailChoice] = {}
"""(rail, local, relay device) -> its one ``RailChoice`` (``rail_choice``): read directly where a batch's path
must not leave its module, and filled through ``rail_choice`` on a miss."""


def rail_choice(rail: int, local: bool, relay_device: int) -> RailChoice:
    """The ``RailChoice`` of these values, made once: it is frozen, and a frozen dataclass's constructor costs
    about a microsecond, which every batch paid per rail (a handful of rails times devices exist)."""
    key = (rail, local, relay_device)
    choice = RAIL_CHOICES.get(key)
    if choice is None:
        choice = RAIL_CHOICES.setdefault(key, RailChoice(rail, local, relay_device))
    return choice


def all_rails_failed(peer: Peer, what: str) -> PeerGone:
    """The error of a batch to ``peer`` that has no usable rail left: ``PeerGone`` with every rail's cause."""
    causes = [pr.cause or PeerLost(f"rail {pr.rail}: endpoint dead") for pr in peer.rails]
    text = "; ".join(f"rail {pr.rail}: {c}" for pr, c in zip(peer.rails, causes))
    return PeerGone(f"{what}: every rail failed ({text})", peer, causes[0] if causes else None, causes)


class Failover:
    """Failing rails and peers, and re-sending a failed rail's work (see the module docstring).

    Arguments: inflight: the ``transport.inflight.InFlight`` (attempts dropped, whether the engine closed);
    accounts: the ``transport.batches.Accounts`` (batches failed); directory: the ``PeerDirectory``; fabrics:
    the rails' fabrics (credit regions are deregistered from them when a peer is forgotten); counters: the
    engine's; config: its ``EngineConfig`` (relay mode and slot size of a re-sent unit). ``connect`` gives it
    the completions (whose queued failures a re-send may wait for) and the dispatch of re-sent units."""

    def __init__(self, inflight, accounts, directory: PeerDirectory, fabrics: list, counters, config):
        self.inflight = inflight
        self.accounts = accounts
        self.directory = directory
        self.fabrics = fabrics
        self.counters = counters
        self.config = config
        self.completions = None
        self.dispatch = None

    def connect(self, completions, dispatch) -> None:
        """``completions``: the ``transport.completions.Completions``; ``dispatch(batch, units, from_engine)``:
        creates and sends attempts of re-sent units (``Pipeline.dispatch``)."""
        self.completions = completions
        self.dispatch = dispatch

    def rail_failed(self, pr: PeerRail, cause: BaseException) -> None:
        """Mark a rail to a peer dead and re-send its unfinished work on the device's other rails."""
        with self.directory.lock:
            if pr.alive:
                pr.alive = False
                pr.cause = cause
                # INFO: its work goes on on the other rails (``stats()`` counts ``rail_failures``); when the
                # last rail goes, forgetting the peer logs the one line of its death, a warning if work was lost
                log.info("rail %d to %s failed (%s); re-dispatching %d unit(s)", pr.rail, pr.remote_id, cause,
                         len(pr.inflight))
                self.counters.add("rail_failures")
            victims = [a for a in pr.inflight if not a.cancelled and not a.finished]
            for a in victims:
                a.cancelled = True
            peer = pr.peer
            if peer is not None and victims:
                peer.lost_work = True
            lost = peer is not None and peer.ready and not peer.retired and not any(r.alive for r in peer.rails)
        with pr.cv:
            pr.cv.notify_all()
        if lost:
            # before the re-dispatch below: it finds no rail and fails the batches with every rail's cause
            self.forget_peer(peer)
        for a in victims:
            # the fabric may still read a slot of a posted write whose completion has not come: that slot is
            # given back by the completion; everything else now
            if not a.posted or a.write_done:
                self.inflight.drop(a)
            if a.batch.failed:
                continue
            self.redispatch(a)

    def _redispatch_unless_failed(self, old, waits: int) -> None:
        if not old.batch.failed:
            self.redispatch(old, waits)

    def fail_peer(self, peer: Peer, cause: Optional[BaseException]) -> None:
        """Fail every rail of ``peer`` (``cause``, or each rail's own: its endpoint died), which forgets it."""
        for pr in list(peer.rails):
            self.rail_failed(pr, cause or pr.cause or PeerLost(f"rail {pr.rail} endpoint to {peer.session} died"))
        self.forget_peer(peer)  # a peer without rails (cannot happen after a handshake) is forgotten too

    def forget_peer(self, peer: Peer) -> None:
        """Every rail to ``peer`` failed: drop what this engine holds for it (session entry, rails, credit region,
        control socket), so that the next batch to its session handshakes from scratch -- with the same process
        back after a network blip, or a new one at the same host:port. Batches still holding this peer keep
        its dead rails and fail with their causes; other peers are not touched. Idempotent."""
        d = self.directory
        closed = self.inflight.closed
        with d.lock:
            if peer.retired:
                return
            peer.retired = True  # from now on the directory replaces it instead of handing it out
            why = "; ".join(f"rail {pr.rail}: {pr.cause or 'endpoint dead'}" for pr in peer.rails)
            if not closed:
                # counted with the flag, under the lock: a batch failed by another thread that found the peer
                # retired must already see it in stats()
                self.counters.add("peers_lost")
                d.lost[peer.session] = why[:500]
                while len(d.lost) > 1024:  # only for error messages: keep the newest
                    d.lost.pop(next(iter(d.lost)))
        # an ack of the old connection still on its way is refused by the fabric (unknown rkey) from now on,
        # instead of landing in a credit region nobody reads
        mrs, peer.credit_mrs = peer.credit_mrs, []
        for fab, mr in zip(self.fabrics, mrs):
            try:
                fab.deregister(mr)
            except FabricError as e:  # a closed fabric released it already
                log.debug("forgetting %s: deregistering the credit region: %s", peer.session, e)
        with d.lock:
            if d.peers.get(peer.session) is peer:
                del d.peers[peer.session]
            for pr in peer.rails:
                if d.by_remote_rail.get(pr.remote_id, (None, None))[0] is peer:
                    del d.by_remote_rail[pr.remote_id]
        # the control socket: shutdown() wakes a region refresh blocked on it from any thread; close it here
        # unless that refresh holds the peer's lock (it closes it on the error it gets)
        sock = peer.ctrl
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if peer.lock.acquire(blocking=False):
                try:
                    close_ctrl_locked(peer)
                finally:
                    peer.lock.release()
        if closed:
            return
        # a peer that closed while idle is routine; one that took batches down with it is worth a warning
        log.log(logging.WARNING if peer.lost_work else logging.INFO,
                "engine %s: every rail to %s failed (%s); forgot the peer, the next batch to it handshakes again",
                self.inflight.session_id, peer.session, why)

    def redispatch(self, old, waits: int = 0) -> None:
        """Send a failed attempt's unit again on another usable rail of its device (relayed or direct as that
        rail's locality says), or fail its batch with every rail's cause when none is left. ``waits``: how often
        this unit already waited for another rail's queued completions (below)."""
        b = old.batch
        u = old.unit
        choices = self.directory.rail_choices(u.device, b.peer)
        if not choices:
            dead = [pr for pr in b.peer.rails if pr.alive and not pr.ep.alive]
            comps = self.completions
            if waits < REDISPATCH_WAITS and any(comps.deferring(pr.rail) for pr in dead):
                # such a rail's completions wait in the progress loop: a failed one among them names the rail's
                # real cause (and fails it), which "endpoint died" would hide; decide after them
                comps.after_deferred(self._redispatch_unless_failed, old, waits + 1)
                return
            # rails whose endpoint died without a completion saying so yet: fail them now, so that the batch
            # names their causes and a peer without any rail left is forgotten before the caller retries
            for pr in dead:
                self.rail_failed(pr, PeerLost(f"rail {pr.rail} endpoint to {b.peer.session} died"))
            if b.peer.ready and not any(pr.alive for pr in b.peer.rails):
                # the thread that failed the last rail may not have forgotten the peer yet; the caller woken by
                # the failure below must find it forgotten (stats, and a fresh handshake on its next batch)
                self.forget_peer(b.peer)
            self.accounts.fail(b, all_rails_failed(b.peer, f"batch {b.id} to {b.peer.session}"))
            return
        load = {pr.rail: pr.bytes_in_flight for pr in b.peer.rails}
        c = min(choices, key=lambda ch: load.get(ch.rail, 0))
        self.counters.add("failovers")
        relay_mode = self.config.relay
        slot_bytes = self.config.relay_slot_bytes
        relay_now = relay_mode == "always" or (relay_mode == "auto" and not c.local)
        if u.kind == COALESCED or (u.kind == RELAYED) == relay_now:
            units = [dataclasses.replace(u, rail=c.rail, relay_device=c.relay_device)]
        elif relay_now:  # direct pieces, and the new rail is not local to their memory: relay them in slot pieces
            units = []
            for s_, d_, length in u.segments():
                off = 0
                while off < length:
                    n = min(slot_bytes, length - off)
                    units.append(Unit(RELAYED, u.device, c.rail, c.relay_device, n, src=s_ + off, dst=d_ + off,
                                      wire_bytes=n, segs=[(s_ + off, d_ + off, n)]))
                    off += n
        else:  # relayed piece(s), and the new rail is local: write them straight from their sources
            units = [Unit(DIRECT, u.device, c.rail, c.relay_device, u.nbytes, src=u.src, dst=u.dst,
                          wire_bytes=u.nbytes, segs=list(u.segments()))]
        if len(units) > 1:
            with b.lock:
                b.remaining += len(units) - 1
        self.dispatch(b, units, from_engine=True)
