"""The planner: turns one batch (srcs, dsts, lengths) into work units bound to rails.

* Small pieces (``length < coalesce_bytes``) of one source device are packed, in order, into chunks that fit a
  relay slot: ``[header | table | payload]`` (``pxn_kernels.chunk``). One chunk = one gather + one fabric write.
  A batch with at most ``direct_pieces`` small host pieces on a device sends them direct instead, with its large
  pieces: on a fabric that carries many writes in one message (tcp) a few pieces cost a few table rows, where a
  chunk adds the gather, a landing slot and the receiver's ack, a thread hand-off at each step.
* Large pieces go direct (zero copy: the WRITE reads the source address) when the chosen rail is local to their
  device, else through relay slots in slot-size pieces. Pieces above ``stripe_bytes`` are cut so that one big
  block is spread over every rail of its device.
* Every unit goes to the rail of its device with the fewest bytes in flight (the engine's live counters plus
  what this plan already assigned), so concurrent batches and mixed sizes balance by bytes, not by count.

Pure and fast: no fabric, no threads; unit-tested on its own.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pxn_kernels.chunk import ENTRY_BYTES, HEADER_BYTES, PAYLOAD_ALIGN
from transport.arrays import distinct

DIRECT, RELAYED, COALESCED = "direct", "relayed", "coalesced"

MIN_RUN_BYTES = 1 << 20
"""Fewest bytes of direct pieces a batch gives each rail it spreads them over (bytes)."""


@dataclass(frozen=True)
class RailChoice:
    """A rail a device may use: ``rail`` index into the engine's rails, ``local`` when the NIC is close to the
    device (PIX/PXB: write straight from its memory), else the data is relayed through ``relay_device``."""

    rail: int
    local: bool
    relay_device: int


@dataclass
class Unit:
    """One work unit. ``kind`` is DIRECT / RELAYED (one contiguous piece) or COALESCED (a chunk of items)."""

    kind: str
    device: int  # source device (-1 host)
    rail: int
    relay_device: int
    nbytes: int  # payload bytes (chunk: sum of item lengths)
    src: int = 0
    dst: int = 0
    items: Optional[np.ndarray] = None  # COALESCED: indices into the batch (None: the chunk's items are ``segs``)
    wire_bytes: int = 0  # bytes that cross the fabric (chunk: header + table + padded payload)
    segs: Optional[List[tuple]] = None  # RELAYED: (src, dst, n) pieces sharing one slot, one write each;
    # COALESCED without items: large pieces forwarded by the peer, as chunk items
    runs: Optional[tuple] = None  # DIRECT / RELAYED runs of whole pieces: (srcs, dsts, lengths) int64 arrays

    def segments(self) -> List[tuple]:
        if self.runs is not None:
            return list(zip(*(a.tolist() for a in self.runs)))
        return self.segs if self.segs is not None else [(self.src, self.dst, self.nbytes)]

    def arrays(self) -> tuple:
        """(srcs, dsts, lengths) of the unit's writes as int64 arrays."""
        if self.runs is not None:
            return self.runs
        segs = self.segments()
        a = np.array(segs, dtype=np.int64).reshape(-1, 3)
        return a[:, 0], a[:, 1], a[:, 2]


def chunk_splits(lengths: np.ndarray, capacity: int) -> List[int]:
    """Split points so that each run of ``lengths`` (in order) fits one chunk of at most ``capacity`` bytes.

    A chunk of n items needs ``align16(64 + 16 n) + sum(align16(len_i))`` bytes; bounding the header alignment
    by 15 B gives a cumulative sum that one ``searchsorted`` per chunk cuts. Returns the end index of each run.
    """
    if lengths.size == 0:
        return []
    per_item = ((lengths + (PAYLOAD_ALIGN - 1)) & ~(PAYLOAD_ALIGN - 1)) + ENTRY_BYTES
    cum = np.cumsum(per_item)
    budget = capacity - HEADER_BYTES - (PAYLOAD_ALIGN - 1)
    if int(per_item.max()) > budget:
        bad = int(np.argmax(per_item))
        raise ValueError(f"piece {bad} of {int(lengths[bad])} B does not fit a chunk of {capacity} B")
    ends = []
    start = 0
    base = 0
    n = lengths.size
    while start < n:
        end = int(np.searchsorted(cum, base + budget, side="right"))
        end = max(end, start + 1)
        ends.append(end)
        base = int(cum[end - 1])
        start = end
    return ends


def chunk_wire_bytes(lengths: np.ndarray) -> int:
    n = int(lengths.size)
    header = (HEADER_BYTES + ENTRY_BYTES * n + PAYLOAD_ALIGN - 1) // PAYLOAD_ALIGN * PAYLOAD_ALIGN
    return header + int(((lengths + (PAYLOAD_ALIGN - 1)) & ~(PAYLOAD_ALIGN - 1)).sum())


class Planner:
    """Plans batches for one engine, with the settings of its ``EngineConfig`` ``cfg`` (all bytes):

    coalesce_bytes: pieces strictly below this are coalesced into chunks.
    chunk_bytes: largest chunk (= landing slot size): ``cfg.relay_slot_bytes`` unless given (a peer whose landing
        slots are smaller; pieces that cannot fit one of its chunks then go direct, whatever ``coalesce_bytes``).
    stripe_bytes: direct pieces above this are cut into pieces of this size to spread over rails.
    relay_slot_bytes: size of one relayed piece (= relay slot size).
    relay: "auto" (relay only where the rail is not local), "always" (every large piece through a slot; the
        benchmark's 'relayed' column), "never" (every large piece direct).
    direct_pieces: a device's small pieces go direct, not into chunks, when they are host memory, at most this
        many, and every rail of the device is local (0: small pieces are always coalesced).
    """

    def __init__(self, cfg, chunk_bytes: Optional[int] = None):
        coalesce_bytes, relay, direct_pieces = cfg.coalesce_bytes, cfg.relay, cfg.direct_pieces
        peer_slots = chunk_bytes is not None
        chunk_bytes = cfg.relay_slot_bytes if chunk_bytes is None else chunk_bytes
        if relay not in ("auto", "always", "never"):
            raise ValueError(f"relay must be 'auto', 'always' or 'never', got {relay!r}")
        if coalesce_bytes < 0:
            raise ValueError(f"coalesce_bytes must be >= 0, got {coalesce_bytes}")
        if isinstance(direct_pieces, bool) or not isinstance(direct_pieces, int) or direct_pieces < 0:
            raise ValueError(f"direct_pieces must be an int >= 0, got {direct_pieces!r}")
        overhead = HEADER_BYTES + ENTRY_BYTES + 2 * PAYLOAD_ALIGN  # one piece's chunk beyond its own bytes
        if coalesce_bytes and chunk_bytes < overhead + coalesce_bytes:
            if not peer_slots:
                raise ValueError(f"chunk (slot) size {chunk_bytes} B cannot hold one piece of coalesce_bytes "
                                 f"{coalesce_bytes} B; need >= {overhead + coalesce_bytes}")
            # a peer's smaller landing slots: pieces too large for one of its chunks go direct to it instead
            coalesce_bytes = max(0, chunk_bytes - overhead)
        self.coalesce_bytes = int(coalesce_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self.stripe_bytes = int(cfg.stripe_bytes)
        self.relay_bytes = int(cfg.relay_slot_bytes)
        self.relay = relay
        self.direct_pieces = direct_pieces
        self._rotate = 0

    def plan(self, srcs: np.ndarray, dsts: np.ndarray, lengths: np.ndarray, devices: np.ndarray,
             rails_of: Dict[int, Sequence[RailChoice]], load: Dict[int, int],
             device_list: Optional[List[int]] = None, dst_devices: Optional[np.ndarray] = None,
             forward: Optional[Dict[int, int]] = None, length_stats: Optional[Tuple[int, int]] = None) -> List[Unit]:
        """Plan one batch.

        Arguments:
            srcs, dsts, lengths, devices: int64 arrays, one entry per item (devices: source device, -1 host).
            rails_of: device -> usable rails (alive, in preference order); every device in ``devices`` present.
            load: rail -> bytes in flight now (updated in place with what this plan adds).
            device_list: the distinct values of ``devices`` when the caller has them (saves a sort per batch);
                with one device given here, ``devices`` may be None (every piece is on it).
            length_stats: (sum, largest) or (sum, largest, smallest) of ``lengths`` when the caller has them
                (saves reductions per batch; with the smallest, a batch that ``whole_batch_rail`` sends whole is
                planned without looking at its arrays).
            dst_devices, forward: receive-side PXN. ``forward`` maps a rail to the peer GPU its chunks land on
                (the GPU next to the peer's NIC); a large piece whose destination device (``dst_devices``) is
                another GPU goes through that rail's landing slots as chunk items, and the peer forwards it over
                NVLink, instead of one write from the NIC across PCIe.
        Returns:
            the work units; each item of the batch is covered exactly once.
        """
        device_list = distinct(devices) if device_list is None else device_list
        if len(device_list) == 1 and length_stats is not None and len(length_stats) > 2:
            dev = device_list[0]
            c = self.whole_batch_rail(dev, rails_of[dev], load, int(lengths.size), length_stats[0],
                                      length_stats[2], length_stats[1], forward)
            if c is not None:
                units = []
                self._add_run(units, DIRECT, dev, c, (srcs, dsts, lengths), length_stats[0], load)
                return units
        units = []
        self._rotate += 1
        small = lengths < self.coalesce_bytes if self.coalesce_bytes else None  # None: no piece is coalesced
        for dev in device_list:
            choices = list(rails_of[dev])
            if not choices:
                raise ValueError(f"no usable rail for device {dev}")
            # rotate ties so that concurrent small batches do not all start on the same rail
            r = self._rotate % len(choices)
            choices = choices[r:] + choices[:r]
            on_dev = devices == dev if len(device_list) > 1 else True  # one device: every piece is on it
            idx_small = np.nonzero(on_dev & small)[0] if small is not None else ()
            if len(idx_small) and not (len(idx_small) <= self.direct_pieces and dev < 0 and forward is None
                                       and self.relay != "always" and all(c.local for c in choices)):
                self._plan_coalesced(units, dev, lengths, idx_small, choices, load)
                idx_large = np.nonzero(on_dev & ~small)[0]
            else:  # nothing coalesced, or the small pieces go with the large ones: every piece of the device
                idx_large = np.arange(lengths.size) if on_dev is True else np.nonzero(on_dev)[0]
            if idx_large.size > 1 and forward is None:
                idx_large = self._plan_runs(units, dev, srcs, dsts, lengths, idx_large, choices, load, length_stats)
            if idx_large.size:
                self._plan_pieces(units, dev, srcs, dsts, lengths, idx_large, choices, load, dst_devices, forward)
        return units

    def _plan_coalesced(self, units, dev, lengths, idx_small, choices, load) -> None:
        """COALESCED units of the small pieces ``idx_small``: in order, as many as fit one chunk, each chunk to the
        least loaded rail."""
        lens_small = lengths[idx_small]
        start = 0
        for end in chunk_splits(lens_small, self.chunk_bytes):
            sel = idx_small[start:end]
            nbytes = int(lens_small[start:end].sum())
            wire = chunk_wire_bytes(lens_small[start:end])
            c = self._least_loaded(choices, load)
            load[c.rail] = load.get(c.rail, 0) + wire
            units.append(Unit(COALESCED, dev, c.rail, c.relay_device, nbytes, items=sel, wire_bytes=wire))
            start = end

    def _plan_runs(self, units, dev, srcs, dsts, lengths, idx_large, choices, load, length_stats) -> np.ndarray:
        """Where every rail of the device takes the large pieces ``idx_large`` the same way (all direct, or all
        relayed), runs of whole pieces in a few numpy calls (a Python step per piece is a large share of a call of
        many pieces). Returns the pieces left for ``_plan_pieces``: those to stripe, or to cut into slots."""
        if self.relay == "never" or (self.relay == "auto" and all(c.local for c in choices)):
            # every large piece goes direct: runs per rail, balanced by bytes; pieces to stripe are left
            every = idx_large.size == lengths.size
            if every and length_stats is not None and length_stats[1] <= self.stripe_bytes:
                # no piece to stripe, by the caller's largest length: one comparison instead of an array's
                self._plan_direct_runs(units, dev, srcs, dsts, lengths, idx_large, choices, load, length_stats[0])
                return idx_large[:0]
            whole = (lengths if every else lengths[idx_large]) <= self.stripe_bytes
            if whole.all():
                self._plan_direct_runs(units, dev, srcs, dsts, lengths, idx_large, choices, load)
                return idx_large[:0]
            self._plan_direct_runs(units, dev, srcs, dsts, lengths, idx_large[whole], choices, load)
            return idx_large[~whole]
        if self.relay == "always" or (self.relay == "auto" and not any(c.local for c in choices)):
            # every rail relays: slot-sized runs of whole pieces
            fit = lengths[idx_large] <= self.relay_bytes
            self._plan_relayed_runs(units, dev, srcs, dsts, lengths, idx_large[fit], choices, load)
            return idx_large[~fit]
        return idx_large

    def _plan_pieces(self, units, dev, srcs, dsts, lengths, idx_large, choices, load, dst_devices, forward) -> None:
        """The large pieces ``idx_large`` one at a time: forwarded by the peer (receive-side PXN) where the rail
        lands next to another GPU than the piece's destination, else direct or relayed, striped."""
        open_relay: Dict[int, Unit] = {}
        open_fwd: Dict[int, Unit] = {}
        for i in idx_large.tolist():
            src, dst, length = int(srcs[i]), int(dsts[i]), int(lengths[i])
            if forward is not None and dst_devices is not None:
                c = self._least_loaded(choices, load)
                land = forward.get(c.rail)
                dd = int(dst_devices[i])
                if land is not None and dd >= 0 and dd != land:
                    self._plan_forwarded(units, dev, src, dst, length, c, load, open_fwd)
                    continue
            self._plan_large(units, dev, src, dst, length, choices, load, open_relay)

    def whole_batch_rail(self, device: int, choices: Sequence[RailChoice], load: Dict[int, int], count: int,
                         nbytes: int, lmin: int, lmax: int, forward: Optional[Dict[int, int]] = None
                         ) -> Optional[RailChoice]:
        """The rail when ``plan`` makes a batch of ``count`` pieces on ``device`` (``nbytes`` in all, lengths
        ``lmin`` to ``lmax`` bytes) one direct unit of every piece in order: nothing to coalesce (or a few host
        pieces that go direct), nothing to stripe or relay, one run. Else None. Decided from those figures alone,
        so a caller learns it without the batch's arrays; counts as a ``plan`` call (the tie rotation)."""
        if not choices or forward is not None:
            return None
        if lmax > self.stripe_bytes and not (count == 1 and lmax - self.stripe_bytes < self.stripe_bytes // 4):
            return None  # striped (a lone piece keeps a tail under a quarter stripe, as ``_plan_large`` does)
        all_local = choices[0].local if len(choices) == 1 else all(c.local for c in choices)
        if self.coalesce_bytes and lmin < self.coalesce_bytes and not (
                count <= self.direct_pieces and device < 0 and self.relay != "always" and all_local):
            return None
        if not (self.relay == "never" or (self.relay == "auto" and all_local)):
            return None
        if count > 1 and len(choices) > 1 and nbytes >= 2 * MIN_RUN_BYTES:
            return None  # runs on several rails (``_plan_direct_runs``)
        self._rotate += 1
        if len(choices) == 1:
            return choices[0]  # one rail (a NIC per host, the common case): no load to compare
        r = self._rotate % len(choices)
        best = None
        for c in list(choices[r:]) + list(choices[:r]):  # the first of the least loaded, as ``plan`` picks
            if best is None or load.get(c.rail, 0) < load.get(best.rail, 0):
                best = c
        return best

    def relays_all(self, choices: Sequence[RailChoice], lmin: int, forward: Optional[Dict[int, int]] = None) -> bool:
        """Whether ``plan`` makes every piece of a batch (smallest length ``lmin``) of a device with these rail
        ``choices`` a RELAYED unit: nothing to coalesce, no receive-side forwarding, and no rail it may write
        from directly."""
        return (bool(choices) and forward is None and not (self.coalesce_bytes and lmin < self.coalesce_bytes)
                and (self.relay == "always" or (self.relay == "auto" and not any(c.local for c in choices))))

    def direct_runs_all(self, choices: Sequence[RailChoice], count: int, lmin: int, lmax: int,
                        forward: Optional[Dict[int, int]] = None) -> bool:
        """Whether ``plan`` makes a batch of ``count`` pieces of one device with these rail ``choices`` (lengths
        ``lmin`` to ``lmax`` bytes) only DIRECT runs of whole pieces, in order, each unit's ``runs`` a slice of
        the batch's arrays: nothing to coalesce, stripe, relay or forward. Decided from those figures alone."""
        return (bool(choices) and count > 1 and forward is None and lmax <= self.stripe_bytes
                and not (self.coalesce_bytes and lmin < self.coalesce_bytes)
                and (self.relay == "never" or (self.relay == "auto" and all(c.local for c in choices))))

    @property
    def turn(self) -> int:
        """The tie rotation's current turn (``plan`` starts its rail choices at this index modulo their count):
        a caller picking a rail alone breaks ties the same way without moving it."""
        return self._rotate

    def rewind(self) -> None:
        """Take back the last call's tie rotation: a caller that asked ``whole_batch_rail`` but did not use the
        rail, and now plans the same batch, gets the same rail from ``plan``."""
        self._rotate -= 1

    @staticmethod
    def _plan_direct_runs(units, dev, srcs, dsts, lengths, idx, choices, load, total_of_all=None) -> None:
        """Direct units of the pieces ``idx``: contiguous runs, one per rail, sized so that every rail ends with
        about the same bytes in flight (its current ``load`` counted). ``total_of_all``: the sum of ``lengths``
        when the caller has it."""
        if not idx.size:
            return
        every = idx.size == lengths.size  # idx holds sorted distinct indices: every piece, in order
        lens = lengths if every else lengths[idx]
        total = total_of_all if every and total_of_all is not None else int(lens.sum())
        if len(choices) == 1 or total < 2 * MIN_RUN_BYTES:
            # one rail: one run (a run costs a post and a completion, tens of us of host time, so a rail takes one
            # only for at least MIN_RUN_BYTES, which takes a 400G NIC longer than that to move)
            c = min(choices, key=lambda c: load.get(c.rail, 0))
            nbytes = total
            run = (srcs, dsts, lengths) if every else (srcs[idx], dsts[idx], lens)
            Planner._add_run(units, DIRECT, dev, c, run, nbytes, load)
            return
        cum = np.cumsum(lens)
        total = int(cum[-1])
        choices = sorted(choices, key=lambda c: load.get(c.rail, 0))  # the least loaded rail takes the first run
        choices = choices[:min(len(choices), total // MIN_RUN_BYTES)]
        loads = [load.get(c.rail, 0) for c in choices]
        share = (total + sum(loads)) / len(choices)
        # each cut after the piece whose running total comes closest to the rail's target; a Python step per
        # rail (a few rails) instead of whole-array numpy calls, each of which costs more than the step
        cuts, target, last = [0], 0.0, idx.size - 1
        for v in loads[:-1]:
            target += max(0.0, share - v)
            i = min(int(cum.searchsorted(target, side="left")), last)
            before = int(cum[i - 1]) if i > 0 else 0
            take = i + 1 if abs(int(cum[i]) - target) <= abs(before - target) else i
            cuts.append(max(take, cuts[-1]))
        cuts.append(idx.size)
        for c, a, b in zip(choices, cuts[:-1], cuts[1:]):
            if b <= a:
                continue
            nbytes = int(cum[b - 1]) - (int(cum[a - 1]) if a else 0)
            if every:  # every piece in order: the run is a slice, views of the batch's arrays
                run = (srcs[a:b], dsts[a:b], lengths[a:b])
            else:
                sel = idx[a:b]
                run = (srcs[sel], dsts[sel], lens[a:b])
            Planner._add_run(units, DIRECT, dev, c, run, nbytes, load)

    def _plan_relayed_runs(self, units, dev, srcs, dsts, lengths, idx, choices, load) -> None:
        """RELAYED units of the pieces ``idx`` (each at most a slot): runs, in order, of as many whole pieces as
        fit one slot, as ``_plan_large`` packs them one at a time; each run to the least loaded rail."""
        if not idx.size:
            return
        every = idx.size == lengths.size  # idx holds sorted distinct indices: every piece, in order
        lens = lengths if every else lengths[idx]
        cum = np.cumsum(lens)
        if int(cum[-1]) <= self.relay_bytes:
            # one slot holds them all (small-piece batches): one run, no list of running totals (its tolist
            # costs most of the planning time of 4096 small pieces)
            c = self._least_loaded(choices, load)
            nbytes = int(cum[-1])
            run = (srcs, dsts, lengths) if every else (srcs[idx], dsts[idx], lens)
            self._add_run(units, RELAYED, dev, c, run, nbytes, load)
            return
        cum = cum.tolist()
        start, base = 0, 0
        while start < idx.size:
            # a Python bisect per run: a numpy call per run cost more where most runs are one piece
            end = max(bisect.bisect_right(cum, base + self.relay_bytes, lo=start), start + 1)
            sel = idx[start:end]
            nbytes = cum[end - 1] - base
            c = self._least_loaded(choices, load)
            self._add_run(units, RELAYED, dev, c, (srcs[sel], dsts[sel], lens[start:end]), nbytes, load)
            base = cum[end - 1]
            start = end

    def _plan_forwarded(self, units, dev, src, dst, length, c: RailChoice, load, open_fwd) -> None:
        """A large piece through the peer's landing slots on rail ``c``: chunk items of at most a chunk's payload,
        several pieces per chunk where they fit."""
        cap = self.chunk_bytes - HEADER_BYTES - ENTRY_BYTES - 2 * PAYLOAD_ALIGN
        off = 0
        while off < length:
            n = min(cap, length - off)
            u = open_fwd.get(c.rail)
            grown = None
            if u is not None:
                lens = np.array([sg[2] for sg in u.segs] + [n], dtype=np.int64)
                grown = chunk_wire_bytes(lens)
            if u is None or grown > self.chunk_bytes:
                wire = chunk_wire_bytes(np.array([n], dtype=np.int64))
                u = Unit(COALESCED, dev, c.rail, c.relay_device, n, wire_bytes=wire, segs=[(src + off, dst + off, n)])
                units.append(u)
                open_fwd[c.rail] = u
                load[c.rail] = load.get(c.rail, 0) + wire
            else:
                u.segs.append((src + off, dst + off, n))
                u.nbytes += n
                load[c.rail] = load.get(c.rail, 0) + grown - u.wire_bytes
                u.wire_bytes = grown
            off += n

    def _plan_large(self, units, dev, src, dst, length, choices, load, open_relay) -> None:
        off = 0
        while off < length:
            c = self._least_loaded(choices, load)
            relayed = self.relay == "always" or (self.relay == "auto" and not c.local)
            step = self.relay_bytes if relayed else self.stripe_bytes
            n = min(step, length - off)
            # a short tail would make one extra tiny write: merge it into this piece when direct
            if not relayed and length - off - n < step // 4:
                n = length - off
            load[c.rail] = load.get(c.rail, 0) + n
            if relayed:
                # pieces smaller than a slot share one: one copy-thread step and one doorbell for several
                u = open_relay.get(c.rail)
                if u is not None and u.nbytes + n <= self.relay_bytes:
                    u.segs.append((src + off, dst + off, n))
                    u.nbytes += n
                    u.wire_bytes += n
                else:
                    u = Unit(RELAYED, dev, c.rail, c.relay_device, n, src=src + off, dst=dst + off, wire_bytes=n,
                             segs=[(src + off, dst + off, n)])
                    units.append(u)
                    open_relay[c.rail] = u
            else:
                units.append(Unit(DIRECT, dev, c.rail, c.relay_device, n, src=src + off, dst=dst + off,
                                  wire_bytes=n))
            off += n

    @staticmethod
    def _add_run(units, kind: str, dev: int, c: RailChoice, run, nbytes: int, load: Dict[int, int]) -> None:
        """One unit of ``kind`` moving ``run`` (its srcs, dsts and lengths arrays, ``nbytes`` in all) on rail
        choice ``c``, counted in ``load``."""
        units.append(Unit(kind, dev, c.rail, c.relay_device, nbytes, src=int(run[0][0]), dst=int(run[1][0]),
                          wire_bytes=nbytes, runs=run))
        load[c.rail] = load.get(c.rail, 0) + nbytes

    @staticmethod
    def _least_loaded(choices: Sequence[RailChoice], load: Dict[int, int]) -> RailChoice:
        best = choices[0]
        best_load = load.get(best.rail, 0)
        for c in choices[1:]:
            v = load.get(c.rail, 0)
            if v < best_load:
                best, best_load = c, v
        return best
