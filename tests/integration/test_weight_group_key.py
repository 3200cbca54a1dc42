"""The weight-update group admits only ranks presenting the run's key, and its rendezvous store listens only while
the group forms (gloo, real processes on CPU)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import pytest

from miles_lite.net.api_key import new_key
from miles_lite.net.ports import LOCAL_HOST, free_port

GROUP = "miles_lite_weights_1"


def _member(rank: int, world: int, port: int, key: str | None, timeout_s: float, out: Any) -> None:
    import torch

    from miles_lite.weight_sync.weight_group import GroupAdmissionError, init_custom_process_group

    start = time.monotonic()
    try:
        group = init_custom_process_group("gloo", LOCAL_HOST, port, rank, world, GROUP, timeout_s, key=key)
    except GroupAdmissionError as exc:
        out.put((rank, key, "refused", str(exc), time.monotonic() - start))
        return
    except Exception as exc:  # the rendezvous timed out
        out.put((rank, key, "failed", repr(exc), time.monotonic() - start))
        return
    tensor = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    torch.distributed.broadcast(tensor, src=0, group=group)
    out.put((rank, key, "joined", tensor.tolist(), time.monotonic() - start))


def _run(members: list[tuple[int, str | None, float]], world: int, delays: list[float] | None = None,
         then: list[tuple[int, str | None, float]] = ()) -> list[tuple]:
    """Run `members` (started `delays` apart), then, once the first of them has reported, `then`."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port(LOCAL_HOST)
    procs = []

    def start(rank: int, key: str | None, timeout_s: float) -> None:
        proc = ctx.Process(target=_member, args=(rank, world, port, key, timeout_s, out))
        proc.start()
        procs.append(proc)

    for i, member in enumerate(members):
        start(*member)
        if delays:
            time.sleep(delays[i])  # order of arrival: the test's subject, not a readiness wait
    results = []
    if then:
        results.append(out.get(timeout=180))
        for member in then:
            start(*member)
    results += [out.get(timeout=180) for _ in range(len(procs) - len(results))]
    for proc in procs:
        proc.join(30)
    return sorted(results, key=lambda r: (r[0], r[2]))


def test_ranks_with_the_key_form_the_group() -> None:
    key = new_key()
    results = _run([(0, key, 60.0), (1, key, 60.0), (2, key, 60.0)], world=3)
    assert [r[2] for r in results] == ["joined"] * 3
    assert all(r[3] == [0.0, 1.0, 2.0, 3.0] for r in results)


def test_a_rank_with_a_wrong_key_is_refused() -> None:
    key = new_key()
    (master, intruder) = _run([(0, key, 8.0), (1, new_key(), 8.0)], world=2)
    assert intruder[2] == "refused" and "API key differs" in intruder[3]
    assert intruder[4] < 8.0  # refused at once, not after the rendezvous timeout
    assert master[2] == "failed"  # the group never formed with it


@pytest.mark.parametrize("intruder_key", ["wrong", None], ids=["wrong-key", "no-key"])
def test_an_intruder_cannot_take_a_members_place(intruder_key: str | None) -> None:
    key = new_key()
    intruder = new_key() if intruder_key == "wrong" else None
    # The intruder dials as rank 1 while the group forms; the real rank 1 arrives once the intruder has its
    # answer (a wrong key: refused at once; no key: it cannot be admitted and times out), and the group forms
    # with it. Waiting for that answer, not a delay, keeps the store open while the intruder tries: a group
    # formed first closes its store, and the intruder would never reach it.
    results = _run([(0, key, 120.0), (1, intruder, 8.0 if intruder is None else 90.0)], world=2,
                   then=[(1, key, 60.0)])
    joined = [r for r in results if r[2] == "joined"]
    assert sorted((r[0], r[1]) for r in joined) == [(0, key), (1, key)]
    assert all(r[3] == [0.0, 1.0, 2.0, 3.0] for r in joined)
    (stray,) = [r for r in results if r[1] == intruder]
    assert stray[2] == ("refused" if intruder_key == "wrong" else "failed")


# ---- formation: the store listens only while the group forms ------------------------------------------------


def _pushing_member(rank: int, world: int, port: int, key: str, senders: int, go: Any, out: Any) -> None:
    """Form the group, report, then (on `go`) run two pushes of the kind `senders` names and report what arrived."""
    import torch

    from miles_lite.weight_sync.weight_group import WarmUp, init_custom_process_group

    try:
        group = init_custom_process_group("gloo", LOCAL_HOST, port, rank, world, GROUP, 60.0, key=key,
                                          warm_up=WarmUp(senders=senders))
    except Exception as exc:
        out.put((rank, "failed", repr(exc)))
        return
    out.put((rank, "formed", None))
    if not go.wait(120):
        out.put((rank, "failed", "no go"))
        return
    received = []
    try:
        for push in (1, 2):
            if senders == 0:  # full mode: every tensor broadcast from rank 0
                tensor = torch.arange(4.0) * push if rank == 0 else torch.zeros(4)
                torch.distributed.broadcast(tensor, src=0, group=group)
                received.append(tensor.tolist())
            elif rank < senders:  # shard mode: every sender sends each receiver its own block
                handles = [torch.distributed.isend(torch.tensor([float(rank), float(dst), float(push)]), dst=dst,
                                                   group=group) for dst in range(senders, world)]
                for handle in handles:
                    handle.wait()
            else:
                bufs = [torch.zeros(3) for _ in range(senders)]
                handles = [torch.distributed.irecv(buf, src=src, group=group) for src, buf in enumerate(bufs)]
                for handle in handles:
                    handle.wait()
                received.append([buf.tolist() for buf in bufs])
    except Exception as exc:
        out.put((rank, "failed", repr(exc)))
        return
    out.put((rank, "pushed", received))


def _connect_errno(port: int) -> int:
    """0 when something accepts a TCP connection on the loopback port, else the connect's errno."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        return sock.connect_ex((LOCAL_HOST, port))


@pytest.mark.parametrize("senders", [0, 2], ids=["broadcast", "p2p"])
def test_a_formed_group_no_longer_listens_and_still_pushes(senders: int) -> None:
    import errno

    key, world = new_key(), 4
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    port = free_port(LOCAL_HOST)
    procs = [ctx.Process(target=_pushing_member, args=(rank, world, port, key, senders, go, out))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        formed = [out.get(timeout=180) for _ in procs]
        assert sorted(r[:2] for r in formed) == [(rank, "formed") for rank in range(world)], formed
        # Rank 0 reports only after closing the store: nothing listens on the rendezvous port any more.
        assert _connect_errno(port) == errno.ECONNREFUSED
        go.set()
        pushed = sorted((out.get(timeout=120) for _ in procs), key=lambda r: r[0])
        assert [r[1] for r in pushed] == ["pushed"] * world, pushed
        for rank, _, received in pushed:
            if senders == 0:
                assert received == [[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]], (rank, received)
            elif rank >= senders:
                assert received == [[[float(s), float(rank), float(push)] for s in range(senders)]
                                    for push in (1, 2)], (rank, received)
        assert _connect_errno(port) == errno.ECONNREFUSED
    finally:
        go.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _sglang_like_member(port: int, go: Any, out: Any) -> None:
    """Rank 1 joining as SGLang 0.5.10's `init_custom_process_group` does: a store client, the group, nothing
    more (no key, no warm-up); then it receives two broadcasts once told to."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=60)
    out.put((1, "started", None))  # imports done: it dials rank 0's store now (and retries until it listens)
    store = dist.TCPStore(LOCAL_HOST, port, 2, False, timeout)
    group, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore(GROUP, store), group_name=GROUP,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    out.put((1, "formed", None))
    if not go.wait(120):
        return
    received = []
    for _ in (1, 2):
        tensor = torch.zeros(4)
        dist.broadcast(tensor, src=0, group=group)
        received.append(tensor.tolist())
    out.put((1, "pushed", received))


@contextlib.contextmanager
def _sglang_like_peer(finish: bool = True) -> Iterator[tuple[int, Any, Any]]:
    """A started `_sglang_like_member` (rank 1); yields (port, go, out). Afterwards the peer is let finish its
    pushes (`finish`) or killed at once (a group that never formed would leave it waiting)."""
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    port = free_port(LOCAL_HOST)
    peer = ctx.Process(target=_sglang_like_member, args=(port, go, out))
    peer.start()
    try:
        # Only what the test exercises may time out, not a peer still starting on a loaded machine.
        assert out.get(timeout=120)[:2] == (1, "started")
        yield port, go, out
    finally:
        if finish:
            go.set()
            peer.join(30)
        peer.kill()
        peer.join(30)


def test_a_group_with_sglangs_own_join_keeps_its_store_until_the_caller_closes_it() -> None:
    import errno

    import torch

    from miles_lite.weight_sync.weight_group import form_group

    with _sglang_like_peer() as (port, go, out):
        formed = form_group("gloo", LOCAL_HOST, port, 0, 2, GROUP, 60.0, warm_up=None)
        assert out.get(timeout=120)[:2] == (1, "formed")
        assert formed.rendezvous is not None and _connect_errno(port) == 0  # its communicators come at a push
        go.set()
        for push in (1, 2):
            torch.distributed.broadcast(torch.arange(4.0) * push, src=0, group=formed.group)
            formed.close_rendezvous()  # what the transport does once the first broadcast reached every engine
            assert _connect_errno(port) == errno.ECONNREFUSED
        assert out.get(timeout=120) == (1, "pushed", [[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]])
        torch.distributed.destroy_process_group(formed.group)


def test_a_warm_up_the_other_ranks_never_run_is_a_clear_error_and_closes_the_store() -> None:
    import errno

    from miles_lite.weight_sync.weight_group import form_group

    with _sglang_like_peer(finish=False) as (port, _go, _out):
        with pytest.raises(TimeoutError, match=r"ranks \[1\] joined but did not finish forming.*warm_up=None"):
            form_group("gloo", LOCAL_HOST, port, 0, 2, GROUP, 10.0)
        assert _connect_errno(port) == errno.ECONNREFUSED
