"""The P/D retry policy's transitions (proxy.routing.pd_states), one by one; the expected values are the policy as
proxy.routing.pd's docstring states it."""

from __future__ import annotations

import itertools

import grpc
import pytest

from proxy.routing.clients import NodeError
from proxy.routing.pd_states import Action, Event, State, Transition, TransitionRefused, failure_event, next_state
from wire import Role

S, E, A = State, Event, Action
RETRYABLE_PREFILL_FAILURES = (E.NODE_LOST, E.PULL_FAILED, E.FAILED_RETRYABLE)

# (state, event) -> the transition, whatever retries are left
FREE = {
    (S.ROUTING, E.ROUTED_COLOCATED): (S.COLOCATED, A.NONE),
    (S.ROUTING, E.ROUTED_DISAGGREGATED): (S.PREFILLING, A.NONE),
    # P's first token goes to the client at once
    (S.PREFILLING, E.PREFILLED): (S.DECODING, A.SEND_FIRST_TOKEN),
    (S.PREFILLING, E.PREFILLED_FINISHED): (S.DONE, A.SEND_FIRST_TOKEN),
    (S.PREFILLING, E.FAILED_FATALLY): (S.FAILED, A.FAIL),
    **{(S.PREFILLING, e): (S.PREFILL_FAILED, A.FIND_PREFILL) for e in RETRYABLE_PREFILL_FAILURES},
    # no prefill node left at all and nothing sent: D prefills the prompt itself, no retry spent
    (S.PREFILL_FAILED, E.NO_NODE_LEFT): (S.COLOCATED, A.PREFILL_ON_DECODE),
    (S.COLOCATED, E.FINISHED): (S.DONE, A.NONE),
    (S.COLOCATED, E.STREAM_BROKEN): (S.MIGRATING, A.MIGRATE),
    # only a D unreachable, lost or silent is worth leaving: its own errors would repeat elsewhere
    (S.COLOCATED, E.NODE_LOST): (S.DECODE_FAILED, A.FIND_DECODE),
    (S.COLOCATED, E.FAILED_FATALLY): (S.FAILED, A.FAIL),
    (S.COLOCATED, E.PULL_FAILED): (S.FAILED, A.FAIL),
    (S.COLOCATED, E.FAILED_RETRYABLE): (S.FAILED, A.FAIL),
    (S.DECODE_FAILED, E.NO_NODE_LEFT): (S.FAILED, A.FAIL),
    (S.DECODING, E.FINISHED): (S.DONE, A.NONE),
    # once D streamed tokens, proxy.routing.migration continues it or it fails (never a replay)
    (S.DECODING, E.STREAM_BROKEN): (S.MIGRATING, A.MIGRATE),
    (S.DECODING, E.FAILED_FATALLY): (S.FAILED, A.FAIL),
    # the retry was spent when D failed: finding the P for the fresh ticket costs none
    (S.TICKET_LOST, E.NODE_FOUND): (S.PREFILLING_AGAIN, A.NONE),
    # no prefill node left after the first token: D goes on alone from it
    (S.TICKET_LOST, E.NO_NODE_LEFT): (S.COLOCATED, A.CONTINUE_ALONE),
    (S.PREFILLING_AGAIN, E.PREFILLED): (S.DECODING, A.NONE),
    (S.PREFILLING_AGAIN, E.PREFILLED_FINISHED): (S.FAILED, A.FAIL),
    (S.PREFILLING_AGAIN, E.FAILED_FATALLY): (S.FAILED, A.FAIL),
    **{(S.PREFILLING_AGAIN, e): (S.PREFILL_AGAIN_FAILED, A.FIND_PREFILL) for e in RETRYABLE_PREFILL_FAILURES},
    (S.PREFILL_AGAIN_FAILED, E.NO_NODE_LEFT): (S.COLOCATED, A.CONTINUE_ALONE),
}
# (state, event) -> the transition while a retry is left; with none left, FAILED
NEEDS_RETRY = {
    (S.PREFILL_FAILED, E.NODE_FOUND): (S.PREFILLING, A.RETRY),
    (S.DECODE_FAILED, E.NODE_FOUND): (S.COLOCATED, A.RETRY),
    (S.PREFILL_AGAIN_FAILED, E.NODE_FOUND): (S.PREFILLING_AGAIN, A.RETRY),
    # D's own retryable error, or P lost while D pulled from it: a fresh ticket for the same D
    (S.DECODING, E.FAILED_RETRYABLE): (S.TICKET_LOST, A.RENEW_TICKET),
    (S.DECODING, E.PREFILL_NODE_LOST): (S.TICKET_LOST, A.RENEW_TICKET),
    # D unreachable, lost or silent, or its pull failed or did not verify: the fault may be D's own
    (S.DECODING, E.NODE_LOST): (S.TICKET_LOST, A.RENEW_TICKET_ON_ANOTHER_DECODE),
    (S.DECODING, E.PULL_FAILED): (S.TICKET_LOST, A.RENEW_TICKET_ON_ANOTHER_DECODE),
}
REFUSED = [key for key in itertools.product(State, Event) if key not in FREE and key not in NEEDS_RETRY]


def key_id(key: tuple[State, Event]) -> str:
    return f"{key[0].value}-{key[1].value}"


@pytest.mark.parametrize("key", list(FREE), ids=key_id)
def test_a_transition_that_takes_no_retry_is_the_same_with_retries_left_or_none(key: tuple[State, Event]) -> None:
    expected = Transition(*FREE[key])
    assert next_state(*key, retries_left=2) == expected
    assert next_state(*key, retries_left=0) == expected


@pytest.mark.parametrize("key", list(NEEDS_RETRY), ids=key_id)
def test_a_transition_that_takes_a_retry_goes_on_while_one_is_left(key: tuple[State, Event]) -> None:
    assert next_state(*key, retries_left=1) == Transition(*NEEDS_RETRY[key])


@pytest.mark.parametrize("key", list(NEEDS_RETRY), ids=key_id)
def test_a_transition_that_takes_a_retry_fails_the_request_when_none_is_left(key: tuple[State, Event]) -> None:
    assert next_state(*key, retries_left=0) == Transition(S.FAILED, A.FAIL)


@pytest.mark.parametrize("key", REFUSED, ids=key_id)
def test_an_event_the_policy_does_not_expect_in_a_state_is_refused(key: tuple[State, Event]) -> None:
    with pytest.raises(TransitionRefused):
        next_state(*key, retries_left=2)


@pytest.mark.parametrize("state", [S.DONE, S.FAILED, S.MIGRATING])
def test_the_end_states_have_no_way_out(state: State) -> None:
    assert all((state, event) in REFUSED for event in Event)


def test_every_state_but_the_end_states_can_be_reached_from_routing() -> None:
    reached, frontier = {S.ROUTING}, [S.ROUTING]
    while frontier:
        state = frontier.pop()
        for event in Event:
            if (state, event) in FREE or (state, event) in NEEDS_RETRY:
                target = next_state(state, event, retries_left=1).state
                if target not in reached:
                    reached.add(target)
                    frontier.append(target)
    assert reached == set(State)


def node_error(node: str, code: grpc.StatusCode, retryable: bool = True) -> NodeError:
    return NodeError(node, code, "message", retryable=retryable)


@pytest.mark.parametrize(("error", "role", "streamed", "event"), [
    # after tokens were streamed, any failure (even a fatal one) breaks the stream
    (node_error("decode d:1", grpc.StatusCode.INTERNAL, retryable=False), Role.DECODE, True, E.STREAM_BROKEN),
    (node_error("decode d:1", grpc.StatusCode.UNAVAILABLE), Role.DECODE, True, E.STREAM_BROKEN),
    (node_error("decode d:1", grpc.StatusCode.INTERNAL, retryable=False), Role.DECODE, False, E.FAILED_FATALLY),
    (node_error("prefill p:1", grpc.StatusCode.UNAVAILABLE, retryable=False), Role.DECODE, False,
     E.FAILED_FATALLY),
    # a decode attempt given up because the P it pulled from was lost names that P
    (node_error("prefill p:1", grpc.StatusCode.UNAVAILABLE), Role.DECODE, False, E.PREFILL_NODE_LOST),
    (node_error("decode d:1", grpc.StatusCode.UNAVAILABLE), Role.DECODE, False, E.NODE_LOST),
    (node_error("decode d:1", grpc.StatusCode.ABORTED), Role.DECODE, False, E.PULL_FAILED),
    (node_error("decode d:1", grpc.StatusCode.DATA_LOSS), Role.DECODE, False, E.PULL_FAILED),
    (node_error("decode d:1", grpc.StatusCode.FAILED_PRECONDITION), Role.DECODE, False, E.FAILED_RETRYABLE),
    (node_error("prefill p:1", grpc.StatusCode.UNAVAILABLE), Role.PREFILL, False, E.NODE_LOST),
    (node_error("prefill p:1", grpc.StatusCode.RESOURCE_EXHAUSTED), Role.PREFILL, False, E.FAILED_RETRYABLE),
    (node_error("prefill p:1", grpc.StatusCode.INVALID_ARGUMENT, retryable=False), Role.PREFILL, False,
     E.FAILED_FATALLY),
])
def test_a_failure_is_the_event_its_code_retryability_and_node_make_it(error: NodeError, role: Role, streamed: bool,
                                                                        event: Event) -> None:
    assert failure_event(error, role, streamed) is event
