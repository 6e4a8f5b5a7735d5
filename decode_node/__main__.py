"""python -m decode_node --model DIR --port N [--kv-backend nixl|mooncake|ipc|auto] [--registry redis://H:P]
[engine flags]"""

from __future__ import annotations

import argparse

from decode_node.clients import PrefillLeaseClient
from decode_node.loop import DecodeLoop
from decode_node.service import DecodeService
from node_common.kv import mismatched_blocks, node_layout_hash, open_connector
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
from node_common.tls import ChannelSecurity, TLSFileError
from node_common.tracing import make_tracer
from protos import tandem_pb2_grpc
from settings import env as environment
from wire import NodeIdentity, Role


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m decode_node", description=__doc__)
    add_node_args(parser)
    args = parse_node_args(parser)
    setup_logging(args.log_level)
    try:  # lease calls to prefill nodes: TLS as the proxy's calls to nodes
        prefill_security = ChannelSecurity.from_settings(args.cluster.tls.client)
    except TLSFileError as e:
        raise SystemExit(f"decode node: {e}") from None
    name = node_id(args, "decode")
    async_engine = load_engine(args, "decode")
    engine = async_engine.engine
    connector, region, _ = open_connector(engine, args.kv_backend, advertised_host(args), name,
                                               args.cluster.transport)
    async_engine.add_ticker(lambda _: connector.progress())
    layout_hash = node_layout_hash(engine)
    store = store_tier(args, async_engine, layout_hash)
    loop = DecodeLoop(async_engine, connector, region, layout_hash, PrefillLeaseClient(prefill_security),
                      verify=lambda block_ids, expected: mismatched_blocks(engine, block_ids, expected), store=store)
    tracer = make_tracer(args.cluster.tracing.otlp_traces_endpoint, "tandem-decode", {"tandem.node_id": name})
    service = DecodeService(loop, async_engine, name, args.model, args.kv_backend, args.max_logprobs, tracer)
    identity = NodeIdentity(name, Role.DECODE, advertised_address(args), args.model, layout_hash, args.kv_backend,
                            args.hash_seed, pod_uid=environment.pod_uid() or "")

    def close() -> None:
        close_node(connector, engine, store)
        tracer.shutdown()  # the spans still buffered go out

    run_node(args, async_engine, identity,
             lambda server: tandem_pb2_grpc.add_DecodeServiceServicer_to_server(service, server), close, store=store)


if __name__ == "__main__":
    main()
