"""The weight-update group admits only ranks presenting the run's key (gloo, real processes on CPU)."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

from miles_lite.api_key import new_key
from miles_lite.ports import LOCAL_HOST, free_port

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


def _run(members: list[tuple[int, str | None, float]], world: int, delays: list[float] | None = None) -> list[tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port(LOCAL_HOST)
    procs = []
    for i, (rank, key, timeout_s) in enumerate(members):
        proc = ctx.Process(target=_member, args=(rank, world, port, key, timeout_s, out))
        proc.start()
        procs.append(proc)
        if delays:
            time.sleep(delays[i])  # order of arrival: the test's subject, not a readiness wait
    results = [out.get(timeout=120) for _ in procs]
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
    # The intruder dials first, as rank 1; the real rank 1 arrives later and the group forms with it.
    # Its timeout leaves room for the master's start on a loaded machine (spawned processes import torch).
    results = _run([(1, intruder, 30.0), (0, key, 60.0), (1, key, 60.0)], world=2, delays=[0.5, 0.5, 0.0])
    joined = [r for r in results if r[2] == "joined"]
    assert sorted((r[0], r[1]) for r in joined) == [(0, key), (1, key)]
    assert all(r[3] == [0.0, 1.0, 2.0, 3.0] for r in joined)
    (stray,) = [r for r in results if r[1] == intruder]
    assert stray[2] == ("refused" if intruder_key == "wrong" else "failed")
