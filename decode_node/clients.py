"""gRPC clients the decode node uses: lease calls to prefill nodes."""

from __future__ import annotations

import logging

import grpc

from node_common.tls import PLAINTEXT, ChannelSecurity
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from wire import KVTicket

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0


class PrefillLeaseClient:
    """Extends and releases tickets on the prefill node that issued them (one channel per address), with the same
    TLS as the proxy's calls to nodes (--node-tls-*)."""

    def __init__(self, security: ChannelSecurity = PLAINTEXT) -> None:
        self.security = security
        self._stubs: dict[str, tandem_pb2_grpc.PrefillServiceStub] = {}

    def _stub(self, address: str) -> tandem_pb2_grpc.PrefillServiceStub:
        if address not in self._stubs:
            self._stubs[address] = tandem_pb2_grpc.PrefillServiceStub(self.security.channel(address))
        return self._stubs[address]

    async def extend(self, ticket: KVTicket, seconds: float) -> bool:
        address = ticket.prefill_address
        ref = pb.TicketRef(ticket_id=ticket.ticket_id, incarnation=ticket.incarnation)
        try:
            response = await self._stub(address).ExtendLease(pb.ExtendLeaseRequest(ticket=ref, seconds=seconds),
                                                             timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            logger.warning("extending ticket %s on %s failed: %s", ticket.ticket_id, address, e.details())
            return False
        return bool(response.ok)

    async def release(self, ticket: KVTicket) -> bool:
        address = ticket.prefill_address
        ref = pb.TicketRef(ticket_id=ticket.ticket_id, incarnation=ticket.incarnation)
        try:
            response = await self._stub(address).Release(ref, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            # the lease frees the blocks on P anyway
            logger.warning("releasing ticket %s on %s failed: %s", ticket.ticket_id, address, e.details())
            return False
        return bool(response.ok)
