"""A sender's credit bookkeeping (transport.fills, transport.completions): a grant that overtakes the receiver's
word that one is coming must not leave the rail waiting ``CREDIT_ASK_S`` for a grant that already came."""
import types

from transport import completions, fills
from transport.peers import Peer, PeerRail
from transport.credits import F_QUEUED, F_RETURNED, ST_OK


class _Counters:
    def add(self, *a):
        pass


def _rail():
    peer = Peer("h:1")
    pr = PeerRail(0, types.SimpleNamespace(alive=True), "r", 0, 0, 4, 1 << 20, peer)
    peer.rails = [pr]
    return peer, pr


def _fills():
    return types.SimpleNamespace(control=None, engine_id=7, counters=_Counters())


def test_queued_reply_overtaken_by_a_grant_lets_the_rail_ask_again(monkeypatch):
    peer, pr = _rail()

    def request(control, peer_, msg, timeout):
        pr.grant([(0, 3)])  # the grant write arrives while the reply is on its way
        return {"ok": True, "grants": [], "queued": True}

    monkeypatch.setattr(fills, "_request", request)
    assert fills.SlotFills._request_credits_locked(_fills(), pr, 1, [], None)
    assert pr.credit_slot == {0: 3}
    assert pr.asked_at == 0.0, "a served queue entry must not hold the rail's next ask back"


def test_queued_reply_without_a_grant_waits_for_it(monkeypatch):
    peer, pr = _rail()
    monkeypatch.setattr(fills, "_request", lambda *a: {"ok": True, "grants": [[1, 2]], "queued": True})
    assert fills.SlotFills._request_credits_locked(_fills(), pr, 2, [], None)
    assert pr.credit_slot == {1: 2}
    assert pr.asked_at > 0.0, "still queued for one more: the rail waits for its grant instead of asking again"


def test_queued_ack_overtaken_by_a_grant_lets_the_rail_ask_again(monkeypatch):
    peer, pr = _rail()
    pr.grant([(0, 3)])
    pr.free_landing.remove(0)  # credit 0 in use by a chunk; its ack returns it to the pool, a grant follows
    pr.asked_at = 0.0
    pr.grant([(1, 5)])  # ... but that grant, written by another thread of the receiver, arrived first
    rec = completions.Completions.__new__(completions.Completions)
    rec.directory = types.SimpleNamespace(by_remote_rail={"r": (peer, pr)})
    ack = types.SimpleNamespace(peer_id="r", imm=None)
    monkeypatch.setattr(completions, "decode_ack", lambda imm: (0, ST_OK | F_RETURNED | F_QUEUED))
    rec.on_ack(0, ack)
    assert 0 not in pr.credit_slot and pr.credit_slot == {1: 5}
    assert pr.asked_at == 0.0
