"""The nodes bound what one request may ask for themselves (issue 13, item 5), whoever calls them: a request for
more top logprobs than --max-logprobs is refused at the gRPC edge with INVALID_ARGUMENT naming the limit, before
it reaches the engine. In-process gRPC servers with the real services; the refusal needs no engine."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, cast

import grpc
import pytest

from decode_node.service import DecodeService
from node_common.options import add_node_args
from prefill_node.service import PrefillService
from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc

MAX_LOGPROBS = 5
NO_ENGINE = cast(Any, None)  # the refusals come before any engine or loop call


def call(rpc: str, request: Any) -> grpc.aio.AioRpcError:
    async def run() -> grpc.aio.AioRpcError:
        server = grpc.aio.server()
        tandem_pb2_grpc.add_PrefillServiceServicer_to_server(
            PrefillService(NO_ENGINE, NO_ENGINE, "layout", "m", "nixl", MAX_LOGPROBS), server)
        tandem_pb2_grpc.add_DecodeServiceServicer_to_server(
            DecodeService(NO_ENGINE, NO_ENGINE, "decode-0", "m", "nixl", MAX_LOGPROBS), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    if rpc == "Prefill":
                        await tandem_pb2_grpc.PrefillServiceStub(channel).Prefill(request, timeout=10)
                    else:
                        async for _ in tandem_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=10):
                            pass
                except grpc.aio.AioRpcError as e:
                    return e
        finally:
            await server.stop(0)
        raise AssertionError("the request was not refused")

    return asyncio.run(run())


def params(logprobs: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=4, logprobs=logprobs)


@pytest.mark.parametrize("rpc", ["Prefill", "Generate"])
def test_more_logprobs_than_the_limit_are_refused_by_name(rpc: str) -> None:
    deadline = time.time() + 30
    request: Any = (pb.PrefillRequest(request_id="r", prompt_token_ids=[1, 2], params=params(10**6),
                                      deadline=deadline) if rpc == "Prefill" else
                    pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], params=params(10**6),
                                       deadline=deadline))
    error = call(rpc, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_LOGPROBS}" in (error.details() or "") and "--max-logprobs" in (error.details() or "")


def test_a_decode_request_cannot_carry_more_first_token_logprobs_than_the_limit_allows() -> None:
    entries = [pb.TokenLogprob(token_id=i, logprob=-1.0, rank=i + 1) for i in range(MAX_LOGPROBS + 2)]
    request = pb.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], params=params(MAX_LOGPROBS),
                                 deadline=time.time() + 30, first_logprobs=pb.PositionLogprobs(entries=entries))
    request.ticket.ticket_id = "t"  # a P/D request: its first token's logprobs came from the prefill node
    error = call("Generate", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "first_logprobs" in (error.details() or "")


def test_the_node_flag_defaults_to_vllms_max_logprobs() -> None:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    assert parser.parse_args(["--model", "m", "--port", "1"]).max_logprobs == 20
    assert parser.parse_args(["--model", "m", "--port", "1", "--max-logprobs", "3"]).max_logprobs == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--port", "1", "--max-logprobs", "-1"])
