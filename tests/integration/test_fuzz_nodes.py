"""Hypothesis at the nodes' gRPC edge: random and garbled messages thrown at a real prefill node and a real decode
node (processes on loopback, tiny model). Whatever arrives, a node answers OK or a status that names the problem
(INVALID_ARGUMENT, FAILED_PRECONDITION, ... with a message), never UNKNOWN or INTERNAL, never dies, and keeps no
request, ticket or KV block of what it refused: Health and Stats say so afterwards.

The decode node gets tickets at every level of damage: random fields, plausible ones (this cluster's layout, the
prefill node's transfer metadata, the right number of blocks) naming blocks and checksums at random, and real
tickets from the prefill node with one thing changed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protos import tandem_pb2 as pb
from protos import tandem_pb2_grpc
from tests.fixtures.tiny_models import VOCAB_SIZE, TinyModelFactory
from tests.integration.openai_cluster import wait_until
from tests.integration.processes import Process, launch_node

pytestmark = pytest.mark.integration

BLOCK_SIZE = 4  # tests/integration/processes.node_args
NUM_KV_BLOCKS = 64
# a refusal names its reason with one of these; CANCELLED is the test's own (it stops reading long streams)
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
            grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED}
FUZZ = settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
RPC_TIMEOUT_S = 30.0


@dataclass
class Nodes:
    prefill: tandem_pb2_grpc.PrefillServiceStub
    decode: tandem_pb2_grpc.DecodeServiceStub
    prefill_address: str
    decode_address: str
    layout_hash: str
    transfer_metadata: bytes  # the prefill node's, from a real ticket
    processes: list[Process]

    def assert_healthy_and_empty(self) -> None:
        """Both nodes alive and ready, and nothing left of the requests: no ticket pinned, every block free."""
        for process in self.processes:
            assert process.alive, process.log()[-4000:]
        assert self.prefill.Health(pb.HealthRequest(), timeout=5).ready
        assert self.decode.Health(pb.HealthRequest(), timeout=5).ready

        stats: list[pb.StatsResponse] = []

        def empty() -> bool:
            p, d = self.prefill.Stats(pb.StatsRequest(), timeout=5), self.decode.Stats(pb.StatsRequest(), timeout=5)
            stats[:] = [p, d]
            return (p.num_pinned_tickets == 0 and p.free_kv_blocks == p.total_kv_blocks and p.num_running == 0
                    and d.num_running == d.num_waiting == 0 and d.free_kv_blocks == d.total_kv_blocks)

        try:
            wait_until(empty, timeout=10)
        except TimeoutError:
            raise AssertionError(f"left on the nodes: prefill {stats[0]}, decode {stats[1]}") from None


@pytest.fixture(scope="module")
def nodes(tiny_model: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    model = tiny_model("llama")
    log_dir = tmp_path_factory.mktemp("fuzz-node-logs")
    processes: list[Process] = []
    channels: list[grpc.Channel] = []
    try:
        prefill, prefill_address = launch_node("prefill", model, "nixl", log_dir)
        processes.append(prefill)
        decode, decode_address = launch_node("decode", model, "nixl", log_dir)
        processes.append(decode)
        for process in processes:
            process.wait_for_line("READY")
        channels = [grpc.insecure_channel(prefill_address), grpc.insecure_channel(decode_address)]
        prefill_stub = tandem_pb2_grpc.PrefillServiceStub(channels[0])
        decode_stub = tandem_pb2_grpc.DecodeServiceStub(channels[1])
        first = prefill_stub.Prefill(pb.PrefillRequest(request_id="metadata", prompt_token_ids=[1, 2, 3, 4, 5],
                                                       params=GREEDY), timeout=RPC_TIMEOUT_S)
        prefill_stub.Release(pb.TicketRef(ticket_id=first.ticket.ticket_id, incarnation=first.ticket.incarnation))
        assert json.loads((Path(model) / "config.json").read_text())["vocab_size"] == VOCAB_SIZE
        nodes = Nodes(prefill_stub, decode_stub, prefill_address, decode_address,
                      decode_stub.Health(pb.HealthRequest()).layout_hash, first.ticket.transfer_metadata,
                      processes)
        nodes.assert_healthy_and_empty()
        yield nodes
    finally:
        for channel in channels:
            channel.close()
        for process in reversed(processes):
            process.stop()


GREEDY = pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, max_tokens=4, ignore_eos=True)

# ---- strategies ----

int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
doubles = st.floats(allow_nan=True, allow_infinity=True)
text = st.text(st.characters(codec="utf-8"), max_size=40)  # proto strings are UTF-8


def small_or(values: st.SearchStrategy[int], low: int, high: int) -> st.SearchStrategy[int]:
    """Mostly values in [low, high] (what a real request would hold), sometimes anything of `values`."""
    return st.one_of(st.integers(low, high), values)


# each field of SamplingParams: a sensible value, or anything its wire type holds
_PARAM_FIELDS: dict[str, tuple[st.SearchStrategy[object], st.SearchStrategy[object]]] = {
    "temperature": (st.floats(0, 2), doubles), "top_p": (st.floats(0.05, 1), doubles),
    "top_k": (st.integers(-1, 50), int32), "min_p": (st.floats(0, 1), doubles),
    "presence_penalty": (st.floats(-2, 2), doubles), "frequency_penalty": (st.floats(-2, 2), doubles),
    "repetition_penalty": (st.floats(0.5, 2), doubles), "min_tokens": (st.integers(0, 3), int32),
    "seed": (st.integers(0, 2**32), int64), "max_tokens": (st.integers(1, 8), int32),
    "logprobs": (st.integers(0, 5), int32), "ignore_eos": (st.booleans(), st.booleans()),
}
_OPTIONAL = {"seed", "max_tokens", "logprobs"}


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    """Sensible sampling parameters with a few fields (none, one, or many) replaced by anything their wire type
    holds: NaN, infinities, huge and negative numbers. max_tokens is usually set: a request without one generates
    up to the context."""
    wild = set(draw(st.lists(st.sampled_from(sorted(_PARAM_FIELDS)), max_size=4)))
    params = pb.SamplingParams(stop_token_ids=draw(st.lists(st.integers(0, 999) if not wild else int32, max_size=3)))
    for name, (sensible, anything) in _PARAM_FIELDS.items():
        if name in _OPTIONAL and not draw(st.integers(0, 4)):
            continue  # unset
        setattr(params, name, draw(anything if name in wild else sensible))
    return params


def prompts() -> st.SearchStrategy[list[int]]:
    """Token ids: mostly a short prompt in the vocabulary; sometimes empty, holding anything an int32 holds, or
    past the context (256)."""
    valid = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)
    return st.one_of(valid, valid, valid, st.lists(small_or(int32, 0, VOCAB_SIZE + 5), max_size=24),
                     st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=250, max_size=300))


# none (0), in a minute, or anything a double holds (past, NaN, infinite)
deadlines = st.one_of(st.just(0.0), st.just(0.0), st.floats(5, 60).map(lambda dt: time.time() + dt), doubles,
                      st.sampled_from([float("nan"), float("inf"), -float("inf")]))


def logprobs() -> st.SearchStrategy[pb.PositionLogprobs]:
    entry = st.builds(pb.TokenLogprob, token_id=small_or(int32, 0, VOCAB_SIZE - 1), logprob=doubles, rank=int32)
    return st.lists(entry, max_size=3).map(lambda entries: pb.PositionLogprobs(entries=entries))


def random_ticket() -> st.SearchStrategy[pb.KVTicket]:
    return st.builds(pb.KVTicket, ticket_id=text, prefill_node_id=text, incarnation=int64,
                     transfer_metadata=st.binary(max_size=64), block_ids=st.lists(int32, max_size=8),
                     num_tokens=int32, layout_hash=text, lease_deadline=doubles,
                     block_checksums=st.lists(text, max_size=8), prefill_address=text)


@st.composite
def plausible_ticket(draw: st.DrawFn, nodes: Nodes, prompt: list[int]) -> pb.KVTicket:
    """A ticket that passes every check of its shape (this layout, one block per 4 prompt tokens, a checksum per
    block, a prefill node that answers) and names blocks, checksums and a lease at random."""
    num_blocks = max(1, -(-len(prompt) // BLOCK_SIZE))
    block_ids = draw(st.lists(small_or(int32, 0, NUM_KV_BLOCKS + 2), min_size=num_blocks, max_size=num_blocks,
                              unique=True))
    checksum = st.one_of(st.text("0123456789abcdef", min_size=1, max_size=32).map(lambda h: f"xxh3-128:{h}"), text)
    return pb.KVTicket(
        ticket_id=draw(st.one_of(st.just("prefill:gone:0"), text)), prefill_node_id="prefill-fuzz",
        incarnation=draw(st.one_of(st.integers(0, 2**62), int64)),
        transfer_metadata=draw(st.one_of(st.just(nodes.transfer_metadata), st.binary(min_size=1, max_size=64))),
        block_ids=block_ids, num_tokens=len(prompt), layout_hash=nodes.layout_hash, lease_deadline=time.time() + 30,
        block_checksums=draw(st.lists(checksum, min_size=num_blocks, max_size=num_blocks)),
        # the prefill node, or a port nothing listens on (never a name to resolve: no DNS in tests)
        prefill_address=draw(st.sampled_from([nodes.prefill_address, "127.0.0.1:1"])))


# ---- calls ----

def refusal(call: object) -> grpc.RpcError | None:
    """None when the call succeeded; else the error, checked to be a named refusal."""
    if not isinstance(call, grpc.RpcError):
        return None
    code = call.code()
    assert code in REFUSALS, f"{code}: {call.details()}"
    assert call.details(), f"{code} without a message"
    return call


def prefill(nodes: Nodes, request: pb.PrefillRequest) -> pb.PrefillResponse | grpc.RpcError:
    try:
        return nodes.prefill.Prefill(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as e:
        return e


def release(nodes: Nodes, ticket: pb.KVTicket) -> None:
    nodes.prefill.Release(pb.TicketRef(ticket_id=ticket.ticket_id, incarnation=ticket.incarnation), timeout=5)


def generate(nodes: Nodes, request: pb.GenerateRequest, max_messages: int = 3) -> grpc.RpcError | None:
    """Reads at most `max_messages` of D's answers, then cancels (an unbounded request would run to the context).
    The error that ended the stream, if any."""
    stream = nodes.decode.Generate(request, timeout=RPC_TIMEOUT_S)
    try:
        for i, response in enumerate(stream):
            assert all(0 <= t < VOCAB_SIZE for t in response.token_ids), response
            if i + 1 >= max_messages:
                stream.cancel()
                break
    except grpc.RpcError as e:
        return e
    return None


request_ids = st.one_of(st.just(""), text, st.uuids().map(str))


# ---- the prefill node ----

def test_the_prefill_node_refuses_random_prefills_by_name_and_keeps_nothing(nodes: Nodes) -> None:
    @FUZZ
    @given(request_id=request_ids, prompt=prompts(), params=sampling_params(), deadline=deadlines)
    def fuzz(request_id: str, prompt: list[int], params: pb.SamplingParams, deadline: float) -> None:
        answer = prefill(nodes, pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, params=params,
                                                  deadline=deadline))
        if refusal(answer) is None:
            assert isinstance(answer, pb.PrefillResponse)
            assert 0 <= answer.first_token < VOCAB_SIZE
            if answer.HasField("ticket"):
                release(nodes, answer.ticket)

    fuzz()
    nodes.assert_healthy_and_empty()


def test_lease_calls_with_random_tickets_change_nothing(nodes: Nodes) -> None:
    refs = st.builds(pb.TicketRef, ticket_id=text, incarnation=int64)

    @FUZZ
    @given(ref=refs, seconds=doubles, request_id=text)
    def fuzz(ref: pb.TicketRef, seconds: float, request_id: str) -> None:
        assert not nodes.prefill.Release(ref, timeout=5).ok
        assert not nodes.prefill.ExtendLease(pb.ExtendLeaseRequest(ticket=ref, seconds=seconds), timeout=5).ok
        assert not nodes.prefill.Abort(pb.AbortRequest(request_id=request_id), timeout=5).found
        assert not nodes.decode.Abort(pb.AbortRequest(request_id=request_id), timeout=5).found

    fuzz()
    nodes.assert_healthy_and_empty()


def test_non_finite_numbers_are_refused_by_both_nodes(nodes: Nodes) -> None:
    """NaN or an infinity in any sampling number or the deadline is INVALID_ARGUMENT at P and at D (colocated):
    NaN passes every range check unnoticed, and no clock reaches an infinite deadline."""
    fields = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "deadline"]

    @settings(FUZZ, max_examples=20)
    @given(field=st.sampled_from(fields), value=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
           prompt=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8))
    def fuzz(field: str, value: float, prompt: list[int]) -> None:
        params = pb.SamplingParams()
        params.CopyFrom(GREEDY)
        deadline = value if field == "deadline" else 0.0
        if field != "deadline":
            setattr(params, field, value)
        answers = [prefill(nodes, pb.PrefillRequest(request_id="non-finite", prompt_token_ids=prompt, params=params,
                                                    deadline=deadline)),
                   generate(nodes, pb.GenerateRequest(request_id="non-finite", prompt_token_ids=prompt, params=params,
                                                      deadline=deadline))]
        for answer in answers:
            assert isinstance(answer, grpc.RpcError) and answer.code() == grpc.StatusCode.INVALID_ARGUMENT, answer
            assert field in answer.details(), answer.details()

    fuzz()
    nodes.assert_healthy_and_empty()


# ---- the decode node ----

def test_the_decode_node_refuses_random_requests_and_tickets_by_name_and_keeps_nothing(nodes: Nodes) -> None:
    @FUZZ
    @given(data=st.data(), request_id=request_ids, prompt=prompts(), params=sampling_params(),
           deadline=deadlines, first_token=small_or(int32, 0, VOCAB_SIZE + 2))
    def fuzz(data: st.DataObject, request_id: str, prompt: list[int], params: pb.SamplingParams, deadline: float,
             first_token: int) -> None:
        request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=params, deadline=deadline,
                                     first_token=first_token,
                                     first_logprobs=data.draw(logprobs()))
        kind = data.draw(st.sampled_from(["colocated", "random", "plausible"]))
        if kind == "random":
            request.ticket.CopyFrom(data.draw(random_ticket()))
        elif kind == "plausible":
            request.ticket.CopyFrom(data.draw(plausible_ticket(nodes, prompt)))
        refusal(generate(nodes, request))

    fuzz()
    nodes.assert_healthy_and_empty()


def _set(field: str, values: st.SearchStrategy[object]) -> Damage:
    return lambda request, data: setattr(request, field, data.draw(values))


def _set_ticket(field: str, values: st.SearchStrategy[object]) -> Damage:
    return lambda request, data: setattr(request.ticket, field, data.draw(values))


Damage = Callable[[pb.GenerateRequest, st.DataObject], None]


# what goes wrong in a request that carries a real ticket
DAMAGES: dict[str, Damage] = {
    "nothing": lambda request, data: None,  # the control: served
    "checksum": lambda request, data: request.ticket.block_checksums.__setitem__(0, data.draw(st.sampled_from(
        ["xxh3-128:0", "xxh3-128:" + "f" * 32, "mix64:00", "nope", "xxh3-128:zz"]))),
    "block id": lambda request, data: request.ticket.block_ids.__setitem__(
        0, data.draw(small_or(int32, 0, NUM_KV_BLOCKS + 2))),
    "block order": lambda request, data: request.ticket.block_ids.reverse(),
    "incarnation": _set_ticket("incarnation", int64),
    "ticket id": _set_ticket("ticket_id", text),
    "num_tokens": _set_ticket("num_tokens", int32),
    "metadata": _set_ticket("transfer_metadata", st.binary(max_size=64)),
    "truncated metadata": lambda request, data: setattr(request.ticket, "transfer_metadata", (
        request.ticket.transfer_metadata[:data.draw(st.integers(0, len(request.ticket.transfer_metadata) - 1))])),
    "lease deadline": _set_ticket("lease_deadline", doubles),
    "first token": _set("first_token", small_or(int32, VOCAB_SIZE - 2, VOCAB_SIZE + 2)),
    "first logprobs": lambda request, data: request.first_logprobs.CopyFrom(data.draw(logprobs())),
    "prompt tokens": lambda request, data: request.prompt_token_ids.__setitem__(
        0, data.draw(small_or(int32, 0, VOCAB_SIZE + 2))),
    "prompt length": lambda request, data: request.prompt_token_ids.append(data.draw(small_or(int32, 0, 9))),
    "params": lambda request, data: request.params.CopyFrom(data.draw(sampling_params())),
    "deadline": _set("deadline", deadlines),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_real_tickets_with_one_thing_wrong_are_served_or_refused_by_name(nodes: Nodes, damage: str) -> None:
    """A real ticket for a real prompt and its first token, handed to D with one thing damaged (in the ticket or
    in the request): D serves it or refuses it by name (a checksum that does not match is DATA_LOSS), and stays
    healthy; P's blocks go back once the ticket is released."""

    @settings(FUZZ, max_examples=10)
    @given(data=st.data(), prompt=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=5, max_size=20))
    def fuzz(data: st.DataObject, prompt: list[int]) -> None:
        prefilled = prefill(nodes, pb.PrefillRequest(request_id=f"real-{time.monotonic_ns()}",
                                                     prompt_token_ids=prompt, params=GREEDY))
        assert isinstance(prefilled, pb.PrefillResponse) and prefilled.HasField("ticket")
        try:  # draws included: hypothesis may end an example at any draw, and the ticket must still go back
            request = pb.GenerateRequest(request_id=f"gen-{time.monotonic_ns()}", prompt_token_ids=prompt,
                                         params=GREEDY, ticket=prefilled.ticket, first_token=prefilled.first_token,
                                         first_logprobs=prefilled.first_logprobs)
            DAMAGES[damage](request, data)
            error = refusal(generate(nodes, request))
            if damage == "nothing":
                assert error is None, error
        finally:
            release(nodes, prefilled.ticket)

    fuzz()
    nodes.assert_healthy_and_empty()


def test_garbled_bytes_are_refused_without_hurting_the_node(nodes: Nodes) -> None:
    """Bytes that are not a protobuf message of the method (or are one, of unknown or mistyped fields) on every
    method of both services."""
    methods = [(nodes.prefill_address, f"/tandem.v1.PrefillService/{name}")
               for name in ("Prefill", "Release", "ExtendLease", "Abort", "Health", "Stats")]
    methods += [(nodes.decode_address, f"/tandem.v1.DecodeService/{name}")
                for name in ("Generate", "Abort", "Health", "Stats")]
    channels = {address: grpc.insecure_channel(address) for address in (nodes.prefill_address, nodes.decode_address)}

    def identity(payload: bytes) -> bytes:
        return payload

    truncated = b"\x0a\xff"  # field 1 (request_id) says 255 bytes follow; none do

    @FUZZ
    @given(method=st.sampled_from(methods), payload=st.binary(max_size=96))
    @example(method=methods[0], payload=truncated)
    @example(method=methods[6], payload=truncated)
    def fuzz(method: tuple[str, str], payload: bytes) -> None:
        address, name = method
        try:
            if name.endswith("/Generate"):
                stream = channels[address].unary_stream(name, request_serializer=identity,
                                                        response_deserializer=identity)(payload, timeout=10)
                next(iter(stream), None)
                stream.cancel()
            else:
                channels[address].unary_unary(name, request_serializer=identity,
                                              response_deserializer=identity)(payload, timeout=10)
        except grpc.RpcError as e:
            refusal(e)

    try:
        fuzz()
    finally:
        for channel in channels.values():
            channel.close()
    nodes.assert_healthy_and_empty()
