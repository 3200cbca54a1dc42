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
"""

from __future__ import annotations

import hmac
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
)

from miles_lite.api_key import derive
from miles_lite.rendezvous import tcp_store

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


def init_custom_process_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    timeout_s: float = 600.0, key: str | None = None,
) -> dist.ProcessGroup:
    """Join (or, as rank 0, host) a named group without touching the default process group.

    Blocks until all `world_size` ranks have joined or `timeout_s` passes. `backend`: gloo | nccl.
    `key`: the run's API key; every rank must give the same (see the module docstring). None: no admission check.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (GPU)")
    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    timeout = timedelta(seconds=timeout_s)
    # The same store SGLang's side expects at master_address:master_port; rank 0 listens on that address only.
    store: dist.Store = tcp_store(master_address, master_port, rank, world_size, timeout)
    if key is not None:
        store = admitted_store(store, key, group_name, rank, f"{master_address}:{master_port}")
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
        group_name=group_name, backend_options=None, timeout=timeout,
    )
    # Group rank == global rank inside this private world, as SGLang records it.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


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
