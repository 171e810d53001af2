"""The queue-pair side of a verbs fabric's connections: an RC QP made with its own CQ, brought from INIT to RTS
towards a peer, and the two ends of the exchange of QP numbers over the connection's TCP channel (``dial`` for
the side that connects, ``answer`` for the side that accepts), plus the loopback QP of the GPUDirect flush.

Everything here runs while the fabric counts the calling thread as building (``VerbsFabric._building``), so that
``close`` never releases the context or PD under it. The fabric's settings (device, port, GID index, queue
sizes, timeouts) are read at each use: they are the fabric's public attributes.
"""
from __future__ import annotations

import random
from typing import Optional

from transport.errors import FabricError
from transport.fabric.verbs_endpoint import recv_json, send_json

RECV_WR_ID = 0  # receives; sends count from 1 per endpoint


class QpSetup:
    """Makes and connects the RC QPs of one ``VerbsFabric`` (``fabric``: its pyverbs objects and settings).
    ``recv_wr``: the receive every QP keeps posted (``max_recv_wr`` of them), into the fabric's scratch MR; the
    fabric reposts it as receives complete."""

    def __init__(self, fabric):
        self.fab = fabric
        v = fabric.v
        scratch = fabric.scratch_mr
        self.recv_wr = v["RecvWR"](wr_id=RECV_WR_ID, num_sge=1, sg=[v["SGE"](scratch.buf, 0, scratch.lkey)])

    def new_qp(self, max_send_wr: Optional[int] = None, max_recv_wr: Optional[int] = None,
               inline: Optional[int] = None, access: Optional[int] = None):
        """A QP in INIT with its own CQ (large enough for every work request and receive it can hold, so that a
        flush cannot overrun it), and the ``max_inline_data`` the device granted."""
        fab = self.fab
        v, e = fab.v, fab.e
        max_send_wr = fab.max_send_wr if max_send_wr is None else max_send_wr
        max_recv_wr = fab.max_recv_wr if max_recv_wr is None else max_recv_wr
        cq = v["CQ"](fab.ctx, max_send_wr + max_recv_wr + 16, None, None, 0)
        qp = None
        for inline in dict.fromkeys((fab.max_inline if inline is None else inline, 0)):
            cap = v["QPCap"](max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=1,
                             max_recv_sge=1, max_inline_data=inline)
            init = v["QPInitAttr"](qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
            try:
                qp = v["QP"](fab.pd, init)
                granted = int(init.cap.max_inline_data)
                break
            except Exception as ex:  # noqa: BLE001 — a device with a smaller inline limit: ask for none
                error = ex
        if qp is None:
            cq.close()
            raise FabricError(f"verbs: cannot create an RC QP on {fab.device} port {fab.port_num}: {error}")
        attr = v["QPAttr"](port_num=fab.port_num)
        attr.qp_access_flags = fab.access if access is None else access
        attr.pkey_index = 0
        try:
            self.transition(qp, "INIT", qp.to_init, attr)
        except FabricError:
            qp.close()
            cq.close()
            raise
        return qp, cq, granted

    def local_info(self, qp, psn: int) -> dict:
        """What the peer needs to bring its QP up towards ``qp`` (sent in the exchange)."""
        fab = self.fab
        pc = fab.port_choice
        return {"id": fab.local_id, "qpn": qp.qp_num, "psn": psn, "gid": fab.gid, "lid": pc.lid, "mtu": pc.mtu}

    def transition(self, qp, state: str, step, attr) -> None:
        """``step(attr)``, moving ``qp`` to ``state``; a refusal becomes a FabricError naming device, port, GID
        index and the state."""
        try:
            step(attr)
        except Exception as ex:  # noqa: BLE001 — PyverbsRDMAError(errno)
            fab = self.fab
            raise FabricError(f"verbs: QP {qp.qp_num} on {fab.device} port {fab.port_num} GID index "
                              f"{fab.gid_index} ({fab.gid}) could not go to {state}: {ex}") from ex

    def bring_up(self, qp, peer: dict, psn: int, receives: Optional[int] = None) -> None:
        """INIT -> RTR -> RTS towards ``peer`` (its qpn, psn, gid, lid, mtu), then post ``receives`` receives
        (default ``max_recv_wr``)."""
        fab = self.fab
        v = fab.v
        try:
            dgid = v["GID"](str(peer["gid"]))
            attr = v["QPAttr"](port_num=fab.port_num)
            attr.path_mtu = min(fab.port_choice.mtu, int(peer["mtu"]))
            attr.dest_qp_num = int(peer["qpn"])
            attr.rq_psn = int(peer["psn"])
            dlid = int(peer["lid"])
        except (KeyError, TypeError, ValueError) as ex:
            raise ValueError(f"malformed verbs peer description {peer!r}: {ex}") from ex
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        gr = v["GlobalRoute"](dgid=dgid, sgid_index=fab.gid_index)
        attr.ah_attr = v["AHAttr"](gr=gr, is_global=1, dlid=dlid, port_num=fab.port_num)
        self.transition(qp, "RTR", qp.to_rtr, attr)
        attr.sq_psn = psn
        attr.timeout = fab.timeout_exp
        attr.retry_cnt = fab.retry_cnt
        attr.rnr_retry = 7  # a receiver out of posted receives is slow, not dead
        attr.max_rd_atomic = 1
        self.transition(qp, "RTS", qp.to_rts, attr)
        for _ in range(fab.max_recv_wr if receives is None else receives):
            qp.post_recv(self.recv_wr)

    def loopback(self, access: int):
        """An RC QP connected to itself with a small CQ (``qp_access_flags`` ``access``): (qp, cq)."""
        qp, cq, _ = self.new_qp(max_send_wr=2, max_recv_wr=1, inline=0, access=access)
        try:
            psn = random.getrandbits(24)
            self.bring_up(qp, self.local_info(qp, psn), psn, receives=0)
        except BaseException:
            qp.close()
            cq.close()
            raise
        return qp, cq

    def dial(self, sock, session):
        """The connecting side's exchange on the authenticated channel ``sock``: a new QP's description sent, the
        peer's received (or its refusal raised as ConnectionError), the QP brought up, then "ready" both ways.
        Returns (qp, cq, granted inline bytes); the QP and CQ are closed when it raises."""
        psn = random.getrandbits(24)
        qp, cq, inline = self.new_qp()
        try:
            send_json(sock, self.local_info(qp, psn), session)
            peer = recv_json(sock, session)
            if "error" in peer:
                raise ConnectionError(f"refused: {peer['error']}")
            self.bring_up(qp, peer, psn)
            send_json(sock, {"ready": True}, session)
            recv_json(sock, session)
        except BaseException:
            qp.close()
            cq.close()
            raise
        return qp, cq, inline

    def answer(self, sock, session, peer: dict):
        """The accepting side's exchange, after the peer's description ``peer`` was received and its claim
        admitted: a new QP's description sent, the QP brought up towards ``peer``, the peer's "ready" received
        (the fabric registers the endpoint before it answers "ready"). Returns (qp, cq, granted inline bytes);
        the QP and CQ are closed when it raises."""
        qp, cq, inline = self.new_qp()
        try:
            psn = random.getrandbits(24)
            send_json(sock, self.local_info(qp, psn), session)
            self.bring_up(qp, peer, psn)
            recv_json(sock, session)
        except BaseException:
            qp.close()
            cq.close()
            raise
        return qp, cq, inline
