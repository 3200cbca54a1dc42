"""The weight-update process group shared by the trainer (rank 0) and engine ranks, as SGLang builds it.

SGLang 0.5.10 (`utils/common.py:init_custom_process_group`, called by `ModelRunner.init_weights_update_group`)
creates the group outside the default process group: a TCP rendezvous at `tcp://master_address:master_port`,
a `PrefixStore(group_name, store)`, then `_new_process_group_helper`. Engine TP rank r joins as
`rank_offset + r`; the trainer is rank 0 and sends every tensor with `broadcast(src=0)`. Both sides must build
the group the same way (the store keys depend on it), so the trainer side and the reference engine both call
`init_custom_process_group` here.

Admission: with the run's API key, rank 0 publishes a nonce and a proof that it holds the key, and every rank
uses store keys under a prefix derived from the key and the nonce. A rank with another key sees a proof it
cannot reproduce and is refused at once (`GroupAdmissionError`); one without the key cannot name the
prefix, so it can neither take a rank nor read what the members exchange through the store. The
collective traffic itself (gloo TCP, NCCL) is neither authenticated nor encrypted. SGLang's own
`init_weights_update_group` (weight_sync.mode=full on SGLang engines) builds its group without a key.

Formation (`form_group`): the store listens only while the group forms. After the process group is created,
every rank runs one collective of each kind the pushes use (`WarmUp`), so every communicator exists, marks
itself formed, and rank 0 closes the store's server once every mark is in: a later connection to the
rendezvous port is refused. Nothing the pushes do goes through the store after that (torch's NCCL group
uses it for communicator creation only, which the warm-up did). What still reaches for it is debugging and
error signalling across ranks: NCCL's heartbeat monitor polls it for another rank's flight-recorder dump
signal (it logs that the store is gone and stops polling), and TORCH_NCCL_PROPAGATE_ERROR, off by default,
would signal errors through it; neither works on a formed group.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
)

from miles_lite.net.api_key import derive
from miles_lite.net.rendezvous import RendezvousServer

_NONCE = "miles_admission/nonce"
_PROOF = "miles_admission/proof"


class GroupAdmissionError(PermissionError):
    """The group's rank 0 holds another key than this rank: it is not admitted."""


def admitted_store(store: dist.Store, key: str, group_name: str, rank: int, where: str) -> dist.Store:
    """`store` under the key-derived prefix of this group, after the key check above (see the module docstring).

    Rank 0 writes the nonce and its proof; other ranks wait for them (up to the store's timeout) and check.
    """
    if rank == 0:
        nonce = secrets.token_hex(16)
        store.set(f"{group_name}/{_PROOF}", derive(key, f"proof/{group_name}/{nonce}"))
        store.set(f"{group_name}/{_NONCE}", nonce)  # last: a joining rank that reads it finds the proof too
    else:
        nonce = store.get(f"{group_name}/{_NONCE}").decode()
        proof = store.get(f"{group_name}/{_PROOF}").decode()
        if not hmac.compare_digest(proof, derive(key, f"proof/{group_name}/{nonce}")):
            raise GroupAdmissionError(
                f"weight-update group {group_name} at {where} refused rank {rank}: its API key differs from the "
                "group's (every process of a run must use the run's key: cluster.api_key_file or MILES_API_KEY)")
    return dist.PrefixStore(derive(key, f"prefix/{group_name}/{nonce}"), store)


# Formation: what rank 0 tells the others, and each one's "my communicators exist" mark.
_PLAN = "miles_formation/warm_up"
_FORMED = "miles_formation/formed"


@dataclass(frozen=True)
class WarmUp:
    """The collectives a group's pushes will use, run once while it forms (rank 0 chooses, the others follow).

    NCCL creates a communicator at the first collective that needs it, through the store (and a point to
    point pair has its own); gloo connects at creation, or per pair at first use with lazy init. Running
    each kind once while the store is up leaves nothing for the pushes to create. `senders` 0: pushes are
    broadcasts from rank 0 (full mode); n > 0: ranks 0..n-1 each send to every rank >= n (shard mode).
    """

    senders: int = 0

    def encode(self) -> str:
        return f"p2p/{self.senders}" if self.senders else "broadcast"

    @staticmethod
    def decode(text: str) -> WarmUp:
        if text == "broadcast":
            return WarmUp()
        kind, _, senders = text.partition("/")
        if kind != "p2p" or not senders.isdigit() or int(senders) < 1:
            raise ValueError(f"weight-update group warm-up {text!r} is not 'broadcast' or 'p2p/N'")
        return WarmUp(int(senders))


@dataclass
class FormedGroup:
    """A formed group; at rank 0, `rendezvous` is its store server while it still listens (see `form_group`)."""

    group: dist.ProcessGroup
    rendezvous: RendezvousServer | None = None

    def close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None


def form_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    timeout_s: float = 600.0, key: str | None = None, warm_up: WarmUp | None = WarmUp(),
) -> FormedGroup:
    """Form a named group without touching the default process group; blocks until every rank is in.

    Rank 0 hosts the store (on `master_address` only) in a `RendezvousServer`; every rank, rank 0 too,
    joins it as a client, passes the key check (`key`, see the module docstring), and creates the process
    group. Then every rank runs rank 0's `warm_up` and marks itself formed; rank 0 waits for every mark and
    closes the server, so the store listens only while the group forms. `warm_up` None (rank 0 only): the
    other ranks do not run this function (SGLang's own group join), so their communicators come at the
    first push: rank 0's server stays up in the returned `rendezvous` for the caller to close after it.
    Any failure closes the server and destroys the half-built group.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")
    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if warm_up is not None and not 0 <= warm_up.senders < world_size:
        raise ValueError(f"warm-up senders={warm_up.senders} must leave receivers in a world of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    server = RendezvousServer(master_address, master_port, world_size, timeout) if rank == 0 else None
    group: dist.ProcessGroup | None = None
    try:
        # The same store SGLang's side expects at master_address:master_port.
        store: dist.Store = (server.client(timeout) if server is not None
                             else dist.TCPStore(master_address, master_port, world_size, False, timeout))
        if key is not None:
            store = admitted_store(store, key, group_name, rank, f"{master_address}:{master_port}")
        if rank == 0:
            store.set(f"{group_name}/{_PLAN}", warm_up.encode() if warm_up is not None else "none")
            plan = warm_up
        else:
            text = store.get(f"{group_name}/{_PLAN}").decode()
            plan = None if text == "none" else WarmUp.decode(text)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
            group_name=group_name, backend_options=None, timeout=timeout,
        )
        # Group rank == global rank inside this private world, as SGLang records it.
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        if rank != 0:
            if plan is not None:
                _run_warm_up(group, plan, rank, world_size, backend)
            store.set(f"{group_name}/{_FORMED}/{rank}", "1")
        elif plan is not None:
            _warm_up_and_wait(store, group, plan, group_name, world_size, backend, timeout)
            assert server is not None
            server.close()
        formed = FormedGroup(group, server if server is not None and server.listening else None)
    except BaseException:
        if server is not None:
            server.close()
        if group is not None:
            dist.destroy_process_group(group)
        raise
    return formed


def init_custom_process_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    timeout_s: float = 600.0, key: str | None = None, warm_up: WarmUp = WarmUp(),
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) a named group; returns once it formed and its store stopped listening.

    `backend`: gloo | nccl. `key`: the run's API key; every rank must give the same (None: no admission
    check). `warm_up`: what the pushes will use (rank 0's is the group's; see `WarmUp`).
    """
    return form_group(backend, master_address, master_port, rank, world_size, group_name, timeout_s, key,
                      warm_up).group


def _warm_up_and_wait(store: dist.Store, group: dist.ProcessGroup, plan: WarmUp, group_name: str, world_size: int,
                      backend: str, timeout: timedelta) -> None:
    """Rank 0's end of formation: its warm-up, then every other rank's mark (each is done with the store then)."""
    marks = [f"{group_name}/{_FORMED}/{r}" for r in range(1, world_size)]
    try:
        _run_warm_up(group, plan, 0, world_size, backend)
        store.wait(marks, timeout)
    except RuntimeError as exc:  # a collective or the wait timed out (gloo, NCCL and store errors all are)
        missing = [r for r, mark in enumerate(marks, start=1) if not store.check([mark])]
        raise TimeoutError(
            f"weight-update group {group_name}: ranks {missing} joined but did not finish forming within "
            f"{timeout.total_seconds():.0f}s ({exc}); ranks that join with SGLang's own init_weights_update_group run "
            "no warm-up: form the group with warm_up=None, i.e. DistributedTransport(engine_warm_up=False)") from exc


def _run_warm_up(group: dist.ProcessGroup, plan: WarmUp, rank: int, world_size: int, backend: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    one = torch.zeros(1, dtype=torch.uint8, device=device)
    if plan.senders == 0:
        dist.broadcast(one, src=0, group=group)
    elif rank < plan.senders:
        # Ascending peers on both sides, as the pushes post them: pairwise communicator creation cannot cycle.
        handles = [dist.isend(one, dst=dst, group=group) for dst in range(plan.senders, world_size)]
        for handle in handles:
            handle.wait()
    else:
        bufs = [torch.empty_like(one) for _ in range(plan.senders)]
        handles = [dist.irecv(buf, src=src, group=group) for src, buf in enumerate(bufs)]
        for handle in handles:
            handle.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the data arrived, so the communicators exist on both ends


def broadcast_receive(group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                      device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Receive one tensor per name from rank 0, in order (SGLang's `update_weights_from_distributed`).

    `dtypes` are torch dtype names ("bfloat16" or "torch.bfloat16"); `shapes` are the full tensor shapes.
    """
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    received: list[tuple[str, torch.Tensor]] = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype {dtype!r} of {name!r} is not a torch dtype name")
        received.append((name, torch.empty([int(d) for d in shape], dtype=torch_dtype, device=device)))
    # Post every receive before waiting, as SGLang does, so rank 0 may issue its sends back to back.
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in received]
    for handle in handles:
        handle.wait()
    return received
