"""python -m prefill_node --model DIR --port N [--kv-backend nixl|mooncake|ipc|auto] [--registry redis://H:P]
[engine flags]"""

from __future__ import annotations

import argparse
import logging

from engine.llm_engine import PinnedBlocks
from node_common.kv import block_checksums, node_layout_hash, open_connector
from node_common.options import (
    add_node_args,
    advertised_host,
    close_node,
    load_engine,
    node_id,
    parse_node_args,
    store_tier,
)
from node_common.registrar import advertised_address
from node_common.server import run_node, setup_logging
from node_common.tracing import make_tracer
from prefill_node.loop import PrefillLoop
from prefill_node.service import PrefillService
from protos import tandem_pb2_grpc
from settings import env as environment
from wire import KVTicket, NodeIdentity, Role

logger = logging.getLogger("prefill_node")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_node", description=__doc__)
    add_node_args(parser)
    parser.add_argument("--lease-seconds", type=float, default=30.0,
                        help="how long pinned blocks wait for a decode node to pull them")
    args = parse_node_args(parser)
    setup_logging(args.log_level)
    name = node_id(args, "prefill")
    async_engine = load_engine(args, "prefill")
    engine = async_engine.engine
    layout_hash = node_layout_hash(engine)
    connector, _, metadata = open_connector(engine, args.kv_backend, advertised_host(args), name,
                                               args.cluster.transport)
    address = advertised_address(args)  # what the registry holds, and what decode nodes call for lease RPCs

    def make_ticket(ticket_id: str, pinned: PinnedBlocks, deadline: float) -> KVTicket:
        blocks = list(pinned.block_ids)
        return KVTicket(ticket_id=ticket_id, prefill_node_id=name, prefill_address=address,
                        incarnation=loop.incarnation, transfer_endpoint=metadata, block_ids=tuple(blocks),
                        num_tokens=pinned.num_tokens, layout_hash=layout_hash, lease_deadline=deadline,
                        block_checksums=block_checksums(engine, blocks))

    store = store_tier(args, async_engine, layout_hash)
    loop = PrefillLoop(async_engine, name, args.lease_seconds, make_ticket, store)
    # the owner of registered memory must keep the transfer library progressing (docs/environment.md#ucx-and-nixl)
    # for decode nodes to read its leased blocks: every idle_wait_s while any block is leased, at rest otherwise
    async_engine.add_ticker(lambda _: connector.progress(), in_flight=lambda: loop.num_pinned > 0)
    tracer = make_tracer(args.cluster.tracing.otlp_traces_endpoint, "tandem-prefill", {"tandem.node_id": name})
    service = PrefillService(loop, async_engine, layout_hash, args.model, args.kv_backend, args.max_logprobs, tracer)
    identity = NodeIdentity(name, Role.PREFILL, address, args.model, layout_hash, args.kv_backend, args.hash_seed,
                            loop.incarnation, pod_uid=environment.pod_uid() or "")

    def close() -> None:
        close_node(connector, engine, store)
        tracer.shutdown()  # the spans still buffered go out

    run_node(args, async_engine, identity,
             lambda server: tandem_pb2_grpc.add_PrefillServiceServicer_to_server(service, server), close, store=store)


if __name__ == "__main__":
    main()
