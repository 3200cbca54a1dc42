"""StarvationRelay: a wait on a rollout result runs the relief on the waiting thread when signalled."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from miles_lite.rollout.starvation import ReliefState, StarvationRelay


def test_a_signal_runs_the_relief_on_the_waiting_thread_and_the_wait_goes_on():
    fut: Future[str] = Future()
    ran: list[str] = []

    def relieve() -> None:
        ran.append(threading.current_thread().name)
        fut.set_result("groups")  # what the relief unblocks: the rollout finishes

    relay = StarvationRelay(relieve)
    relay.signal()
    relay.signal()  # a second request before the relief runs counts once
    assert relay.wait(fut, timeout_s=5.0) == "groups"
    assert ran == [threading.current_thread().name] and relay.reliefs == 1 and relay.state is ReliefState.IDLE


def test_a_signal_from_another_thread_wakes_the_wait():
    fut: Future[int] = Future()
    relay = StarvationRelay(lambda: fut.set_result(7))
    threading.Timer(0.05, relay.signal).start()
    assert relay.wait(fut, timeout_s=5.0) == 7


def test_without_a_signal_the_wait_is_a_plain_result_and_errors_pass_through():
    relay = StarvationRelay(lambda: None)
    fut: Future[int] = Future()
    threading.Timer(0.05, fut.set_exception, (RuntimeError("rollout failed"),)).start()
    with pytest.raises(RuntimeError, match="rollout failed"):
        relay.wait(fut, timeout_s=5.0)
    with pytest.raises(TimeoutError):
        relay.wait(Future(), timeout_s=0.05)
    assert relay.reliefs == 0


def test_a_failing_relief_ends_the_wait_and_leaves_the_relay_idle():
    def relieve() -> None:
        raise ValueError("push failed")

    relay = StarvationRelay(relieve)
    relay.signal()
    with pytest.raises(ValueError, match="push failed"):
        relay.wait(Future(), timeout_s=5.0)
    assert relay.state is ReliefState.IDLE
