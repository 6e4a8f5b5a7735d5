"""The P/D retry policy of one request, as a state machine (proxy.routing.pd runs it and does the I/O).

The states of one request's path, and the events that move it (`next_state` is the whole policy; it is pure):

    ROUTING --colocated--> COLOCATED           D prefills the prompt itself and streams every token
       |                      |  ^
       | disaggregated        |  +--NODE_FOUND (a retry)-- DECODE_FAILED <--NODE_LOST-- (D unreachable, lost, silent)
       v                      +--FINISHED--> DONE; STREAM_BROKEN--> MIGRATING; another failure or none left--> FAILED
    PREFILLING --a retryable failure--> PREFILL_FAILED --NODE_FOUND (a retry)--> PREFILLING
       |                                      +--NO_NODE_LEFT--> COLOCATED (nothing sent: D prefills it itself)
       +--PREFILLED_FINISHED--> DONE (the first token finished it)
       | PREFILLED: the first token goes to the client
       v
    DECODING --FINISHED--> DONE; STREAM_BROKEN--> MIGRATING (proxy.routing.migration); not retryable--> FAILED
       | a retryable failure before D streamed (a retry): the ticket released; on another D when D was at fault
       v
    TICKET_LOST --NODE_FOUND--> PREFILLING_AGAIN --PREFILLED--> DECODING (with the fresh ticket)
       |                              +--a retryable failure--> PREFILL_AGAIN_FAILED --NODE_FOUND (a retry)--> ...
       +--NO_NODE_LEFT--> COLOCATED (D goes on alone from the first token; so does PREFILL_AGAIN_FAILED's)

A retry takes one of the request's `max_retries`: `retries_left` is what is left of them; with none left, a
transition that needs one goes to FAILED. A retryable failure of a prefill node is retried on another P before
a retry is spent, so finding no P left costs none. MIGRATING hands the request to proxy.routing.migration, which
continues it (a retry too) as a COLOCATED run on another D from the tokens sent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from proxy.routing.clients import NodeError
from wire import Role

# D's pull of the K/V failed (ABORTED) or the blocks it pulled did not verify (DATA_LOSS): the fault may be D's own
PULL_FAILURES = (grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS)


class State(enum.Enum):
    ROUTING = "routing"  # the router picked D, the mode and P; nothing ran yet
    PREFILLING = "prefilling"  # P computes the prompt's K/V and the first token; nothing sent yet
    PREFILL_FAILED = "prefill_failed"  # P failed, nothing sent: looking for another P
    COLOCATED = "colocated"  # D prefills the prompt (after the tokens sent, if any) and streams the tokens
    DECODE_FAILED = "decode_failed"  # a colocated D failed before streaming: looking for another D
    DECODING = "decoding"  # the first token sent; D pulls the K/V under P's ticket and streams the rest
    TICKET_LOST = "ticket_lost"  # D failed before streaming, the ticket released: looking for a P for a fresh one
    PREFILLING_AGAIN = "prefilling_again"  # P computes a fresh ticket; the first token was sent already
    PREFILL_AGAIN_FAILED = "prefill_again_failed"  # that P failed: looking for another P
    MIGRATING = "migrating"  # D broke after streaming: proxy.routing.migration takes the request over
    DONE = "done"
    FAILED = "failed"  # the request ends with the last failure


class Event(enum.Enum):
    ROUTED_COLOCATED = "routed_colocated"
    ROUTED_DISAGGREGATED = "routed_disaggregated"
    PREFILLED = "prefilled"  # P answered: a first token and a ticket for D
    PREFILLED_FINISHED = "prefilled_finished"  # P answered with a first token that finished the request
    FINISHED = "finished"  # D's stream ended
    STREAM_BROKEN = "stream_broken"  # D failed after it had streamed tokens
    FAILED_FATALLY = "failed_fatally"  # not retryable: it would fail again
    NODE_LOST = "node_lost"  # retryable: the attempt's node was unreachable, or the proxy gave up on it
    PULL_FAILED = "pull_failed"  # retryable: D's pull of the K/V failed or did not verify
    PREFILL_NODE_LOST = "prefill_node_lost"  # retryable: the P that D pulled from was lost
    FAILED_RETRYABLE = "failed_retryable"  # retryable, by the node's own account (a stale ticket, ...)
    NODE_FOUND = "node_found"  # the router has a node for the next attempt (maybe the one that failed)
    NO_NODE_LEFT = "no_node_left"  # the router has none


class Action(enum.Enum):
    """What the driver does on a transition, besides running the new state's attempt."""

    NONE = "none"
    SEND_FIRST_TOKEN = "send_first_token"  # P's first token goes to the client
    FIND_PREFILL = "find_prefill"  # ask the router for another P (Event NODE_FOUND or NO_NODE_LEFT)
    FIND_DECODE = "find_decode"  # ask the router for another D
    RETRY = "retry"  # spend a retry on the node found (pausing first when it is the one that failed)
    RENEW_TICKET = "renew_ticket"  # spend a retry, abort D's attempt if given up, release the ticket, FIND_PREFILL
    RENEW_TICKET_ON_ANOTHER_DECODE = "renew_ticket_on_another_decode"  # the same, on another D (D was at fault)
    PREFILL_ON_DECODE = "prefill_on_decode"  # no P left, nothing sent: D prefills the prompt itself
    CONTINUE_ALONE = "continue_alone"  # no P left after the first token: D goes on alone from it
    MIGRATE = "migrate"  # raise DecodeStreamBroken for proxy.routing.migration
    FAIL = "fail"  # raise the failure


@dataclass(frozen=True)
class Transition:
    state: State
    action: Action


class TransitionRefused(Exception):
    """An event that the policy does not allow in a state: a bug in the driver."""

    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"no transition from {state.value} on {event.value}")
        self.state = state
        self.event = event


# the states that wait for the router's answer on a prefill node (Event NODE_FOUND or NO_NODE_LEFT)
LOOKING_FOR_PREFILL = (State.PREFILL_FAILED, State.TICKET_LOST, State.PREFILL_AGAIN_FAILED)
_FAIL = Transition(State.FAILED, Action.FAIL)
_RETRYABLE = (Event.NODE_LOST, Event.PULL_FAILED, Event.FAILED_RETRYABLE)  # of a prefill attempt


def _table() -> dict[tuple[State, Event], Transition]:
    table = {
        (State.ROUTING, Event.ROUTED_COLOCATED): Transition(State.COLOCATED, Action.NONE),
        (State.ROUTING, Event.ROUTED_DISAGGREGATED): Transition(State.PREFILLING, Action.NONE),
        (State.PREFILLING, Event.PREFILLED): Transition(State.DECODING, Action.SEND_FIRST_TOKEN),
        (State.PREFILLING, Event.PREFILLED_FINISHED): Transition(State.DONE, Action.SEND_FIRST_TOKEN),
        (State.PREFILLING, Event.FAILED_FATALLY): _FAIL,
        (State.PREFILL_FAILED, Event.NO_NODE_LEFT): Transition(State.COLOCATED, Action.PREFILL_ON_DECODE),
        (State.COLOCATED, Event.FINISHED): Transition(State.DONE, Action.NONE),
        (State.COLOCATED, Event.STREAM_BROKEN): Transition(State.MIGRATING, Action.MIGRATE),
        (State.COLOCATED, Event.NODE_LOST): Transition(State.DECODE_FAILED, Action.FIND_DECODE),
        # D's other errors would repeat on another D; a colocated D pulls from no P
        (State.COLOCATED, Event.FAILED_FATALLY): _FAIL,
        (State.COLOCATED, Event.PULL_FAILED): _FAIL,
        (State.COLOCATED, Event.FAILED_RETRYABLE): _FAIL,
        (State.DECODE_FAILED, Event.NO_NODE_LEFT): _FAIL,
        (State.DECODING, Event.FINISHED): Transition(State.DONE, Action.NONE),
        (State.DECODING, Event.STREAM_BROKEN): Transition(State.MIGRATING, Action.MIGRATE),
        (State.DECODING, Event.FAILED_FATALLY): _FAIL,
        (State.TICKET_LOST, Event.NODE_FOUND): Transition(State.PREFILLING_AGAIN, Action.NONE),  # the retry is spent
        (State.TICKET_LOST, Event.NO_NODE_LEFT): Transition(State.COLOCATED, Action.CONTINUE_ALONE),
        (State.PREFILLING_AGAIN, Event.PREFILLED): Transition(State.DECODING, Action.NONE),
        # a first token that finishes now did not before (the first one went out unfinished): D's failure stands
        (State.PREFILLING_AGAIN, Event.PREFILLED_FINISHED): _FAIL,
        (State.PREFILLING_AGAIN, Event.FAILED_FATALLY): _FAIL,
        (State.PREFILL_AGAIN_FAILED, Event.NO_NODE_LEFT): Transition(State.COLOCATED, Action.CONTINUE_ALONE),
    }
    for event in _RETRYABLE:
        table[(State.PREFILLING, event)] = Transition(State.PREFILL_FAILED, Action.FIND_PREFILL)
        table[(State.PREFILLING_AGAIN, event)] = Transition(State.PREFILL_AGAIN_FAILED, Action.FIND_PREFILL)
    return table


_TRANSITIONS = _table()
# transitions that take a retry: with none left they go to FAILED
_IF_RETRY_LEFT = {
    (State.PREFILL_FAILED, Event.NODE_FOUND): Transition(State.PREFILLING, Action.RETRY),
    (State.DECODE_FAILED, Event.NODE_FOUND): Transition(State.COLOCATED, Action.RETRY),
    (State.PREFILL_AGAIN_FAILED, Event.NODE_FOUND): Transition(State.PREFILLING_AGAIN, Action.RETRY),
    # P lost while D pulled from it, or D's own retryable error: the same D, a fresh ticket
    (State.DECODING, Event.PREFILL_NODE_LOST): Transition(State.TICKET_LOST, Action.RENEW_TICKET),
    (State.DECODING, Event.FAILED_RETRYABLE): Transition(State.TICKET_LOST, Action.RENEW_TICKET),
    # D itself failed that way (a faulty D would fail every retry): another D too
    (State.DECODING, Event.NODE_LOST): Transition(State.TICKET_LOST, Action.RENEW_TICKET_ON_ANOTHER_DECODE),
    (State.DECODING, Event.PULL_FAILED): Transition(State.TICKET_LOST, Action.RENEW_TICKET_ON_ANOTHER_DECODE),
}


def next_state(state: State, event: Event, retries_left: int) -> Transition:
    """Where `event` takes a request in `state`, and what to do on the way. Raises TransitionRefused for an event
    that the policy does not expect there."""
    transition = _TRANSITIONS.get((state, event))
    if transition is not None:
        return transition
    transition = _IF_RETRY_LEFT.get((state, event))
    if transition is None:
        raise TransitionRefused(state, event)
    return transition if retries_left > 0 else _FAIL


def failure_event(failure: NodeError, attempt_role: Role, streamed: bool) -> Event:
    """The event of `failure` of an attempt on a node of `attempt_role`; `streamed`: the attempt had streamed
    tokens (what was sent stays sent). A decode attempt fails with a prefill node's error when the proxy gave
    up on the P that D pulled from."""
    if streamed:
        return Event.STREAM_BROKEN
    if not failure.retryable:
        return Event.FAILED_FATALLY
    if attempt_role is Role.DECODE and failure.role == Role.PREFILL.value:
        return Event.PREFILL_NODE_LOST
    if failure.try_another_node:
        return Event.NODE_LOST
    if failure.code in PULL_FAILURES:
        return Event.PULL_FAILED
    return Event.FAILED_RETRYABLE
