"""The trainer role as a Ray gang: one actor per rank in its own placement-group bundle.

`RayTrainerGroup.start(cfg)` reserves the trainer gang (all bundles or none), starts one
`TrainerRank` actor per bundle, lets rank 0 pick the torch.distributed rendezvous (its node address
and a free port) and builds a `TrainerActor` on every rank. Every call of the driver is sent to all
ranks with the same arguments (the actor splits a batch over data-parallel ranks itself) and rank 0's
answer is returned; weight shards come from the data-parallel rank 0 of every TP rank, and routed experts of
expert-parallel ranks outside it from one rank of each (the weight senders, `rank.weight_senders`).

Lifecycle: NEW -> STARTING -> READY -> CLOSED; a rank that dies, a call that leaves ranks stuck in a
collective, or a failed start leaves FAILED, where only `close()` is allowed.
"""

from __future__ import annotations

import enum
import math
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from miles_lite.checkpoint.async_ckpt import SaveStats
from miles_lite.checkpoint.driver_state import DriverState
from miles_lite.cluster.gang import reserve, trainer_gang
from miles_lite.cluster.rank import RankCoords, TrainerRank, expert_senders, weight_senders
from miles_lite.config.schema import ClusterConfig
from miles_lite.config.views import TrainerRoleConfig
from miles_lite.trainer.layout import ParamLayout
from miles_lite.trainer.offload import OverlapRoom
from miles_lite.types import TrainBatch

# After one rank raised, how long the others may take to finish the same call before the gang is
# declared stuck (a rank that raised mid-collective leaves its peers waiting for the gloo/NCCL timeout).
STRAGGLER_GRACE_S = 30.0
# How long `close()` waits for the ranks to leave their process groups before killing them.
CLOSE_GRACE_S = 30.0


class TrainerGangLostError(RuntimeError):
    """A trainer rank died or the gang can no longer run collectives; the run must restart its trainer."""


class GroupState(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class RayTrainerRank(TrainerRank):
    """Body of one trainer rank's Ray actor; rank 0 also hosts the process-group rendezvous."""

    def rendezvous(self) -> str:
        """`tcp://<this node's address>:<free port>`: the process-group rendezvous rank 0 will host."""
        from miles_lite.net.ports import free_port, node_address

        address = node_address()
        return f"tcp://{address}:{free_port(address)}"

    def weight_group_endpoint(self, advertise: str | None) -> tuple[str, int]:
        """(address, port) the engines dial to join the weight-update group this rank hosts as group rank 0:
        `advertise` or this node's address, and a port free on this node."""
        from miles_lite.net.ports import free_port, node_address

        return node_address(advertise), free_port("")


def _init_ray(cluster: ClusterConfig, cpus: float) -> bool:
    """Connect to `cluster.ray_address`, or start a local instance sized for the gang; True if this call did.

    A Ray session already open in this process (a test, an embedding application) is reused.
    """
    import ray

    if ray.is_initialized():
        return False
    # Ray >= 2.50 turns token authentication on by default and writes ~/.ray/auth_token; a job-local
    # instance needs neither.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # ray.init installs its own handler for SIGTERM (it logs and aborts the driver) over the process's:
    # the graceful stop (finish the step, checkpoint, exit 0) keeps the handlers it installed.
    handlers = _python_stop_handlers()
    if cluster.ray_address:
        ray.init(address=cluster.ray_address, log_to_driver=False)
    else:
        # "local": a Ray of this run's own, never a cluster some earlier `ray start` left recorded on the
        # machine (with num_cpus given, joining that one fails, or it is stale and the call hangs).
        ray.init(address="local", num_cpus=max(1, math.ceil(cpus)), include_dashboard=False, log_to_driver=False)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    return True


def _python_stop_handlers() -> dict[signal.Signals, Any]:
    """The Python handlers of the stop signals, when this is the main thread (the only one that may set them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    # None: a handler not installed from Python, which cannot be put back from here.
    return {sig: h for sig, h in handlers.items() if h is not None}


class RayTrainerGroup:
    """A `TrainerRole` of `tp * dp` ranks as Ray actors (every call goes to all ranks; rank 0 answers)."""

    def __init__(self, cfg: TrainerRoleConfig) -> None:
        self.cfg = cfg
        self.state = GroupState.NEW
        self.world_size = cfg.actor.trainer.world_size
        self.actors: list[Any] = []
        self.coords: list[RankCoords] = []
        self.placement_group: Any = None
        self.owns_ray = False
        self._layouts: list[ParamLayout] | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def start(cls, cfg: TrainerRoleConfig) -> RayTrainerGroup:
        """Reserve the trainer gang and build every rank; raises (and releases everything) on failure.

        Raises `GangSchedulingError` when the gang cannot be placed within `cluster.placement_timeout_s`,
        `TimeoutError` when the ranks are not built within `cluster.trainer_start_timeout_s`.
        """
        group = cls(cfg)
        try:
            group._start()
        except BaseException:
            group.close()
            raise
        return group

    def _start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.state = GroupState.STARTING
        spec = trainer_gang(self.cfg.actor.trainer, self.cfg.cluster)
        self.owns_ray = _init_ray(self.cfg.cluster, spec.total().get("CPU", 1.0))
        self.placement_group = reserve(spec, self.cfg.cluster.placement_timeout_s)
        remote_cls = ray.remote(RayTrainerRank)
        for rank, bundle in enumerate(spec.bundles):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            self.actors.append(remote_cls.options(
                num_cpus=bundle.get("CPU", 1.0), num_gpus=bundle.get("GPU", 0.0), resources=resources,
                max_restarts=0, scheduling_strategy=strategy).remote())
        timeout = self.cfg.cluster.trainer_start_timeout_s
        init_method = self._collect({0: self.actors[0].rendezvous.remote()}, "rendezvous", timeout)[0]
        total_steps = self.cfg.actor.steps
        refs = {rank: actor.setup.remote(self.cfg, rank, self.world_size, init_method, total_steps)
                for rank, actor in enumerate(self.actors)}
        self.coords = self._collect(refs, "setup", timeout)
        self.state = GroupState.READY

    def close(self) -> None:
        """Leave the process groups, kill every rank, release the gang and stop Ray if `start` began it."""
        if self.state is GroupState.CLOSED:
            return
        import ray

        if self.actors and self.state is GroupState.READY:
            refs = [actor.close.remote() for actor in self.actors]
            # Ranks that do not leave in time are killed below all the same.
            ray.wait(refs, num_returns=len(refs), timeout=CLOSE_GRACE_S)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        self.owns_ray = False
        self.state = GroupState.CLOSED

    def __enter__(self) -> RayTrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls on ranks -------------------------------------------------------------------------

    def _require_ready(self) -> None:
        if self.state is not GroupState.READY:
            raise TrainerGangLostError(
                f"the trainer gang is {self.state.value}; only a ready gang runs calls"
                + (" (a rank died or got stuck earlier: restart the trainer, resuming from a checkpoint)"
                   if self.state is GroupState.FAILED else ""))

    def _collect(self, refs: dict[int, Any], what: str, timeout_s: float | None = None) -> list[Any]:
        """Results of `refs` (rank -> ObjectRef), in rank order; fails fast on the first dead or failed rank."""
        import ray
        from ray.exceptions import RayActorError

        by_ref = {ref: rank for rank, ref in refs.items()}
        results: dict[int, Any] = {}
        pending = list(refs.values())
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                self.state = GroupState.FAILED
                waiting = sorted(by_ref[r] for r in pending)
                raise TimeoutError(f"trainer ranks {waiting} did not finish {what} within {timeout_s:.0f} s "
                                   "(raise cluster.trainer_start_timeout_s for large models)")
            rank = by_ref[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as exc:
                self.state = GroupState.FAILED
                raise TrainerGangLostError(f"trainer gang lost: rank {rank} died during {what} ({exc}); "
                                           "restart the trainer, resuming from the last checkpoint") from exc
            except Exception:
                self._drain_after_error(pending)
                raise
        return [results[rank] for rank in sorted(results)]

    def _drain_after_error(self, pending: list[Any]) -> None:
        """After a rank raised: the gang stays usable only if every other rank finishes the call too."""
        import ray

        if not pending:
            return
        _, stuck = ray.wait(pending, num_returns=len(pending), timeout=STRAGGLER_GRACE_S)
        if stuck:
            # They wait in a collective the failed rank never joined: the gang cannot run more calls.
            self.state = GroupState.FAILED

    def _all(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on every rank; rank 0's result."""
        return self._every(method, *args)[0]

    def _every(self, method: str, *args: Any) -> list[Any]:
        """Run `method(*args)` on every rank; every rank's result, in rank order."""
        self._require_ready()
        refs = {rank: getattr(actor, method).remote(*args) for rank, actor in enumerate(self.actors)}
        return self._collect(refs, method)

    # ---- the TrainerRole calls -----------------------------------------------------------------

    def layouts(self) -> list[ParamLayout]:
        """Parameter layouts of TP rank 0 (they describe every rank's sharding), routed experts of every EP rank."""
        self._require_ready()
        if self._layouts is None:
            self._layouts = self._collect({0: self.actors[0].layouts.remote()}, "layouts")[0]
        return list(self._layouts)

    def _sender_ranks(self) -> list[int]:
        """Global rank of every weight sender (index = sender: TP ranks of DP rank 0, then expert holders)."""
        self._require_ready()
        return weight_senders(self.coords, self.cfg.actor.trainer.tp)

    def expert_senders(self) -> dict[int, int]:
        """Global routed expert -> the sender holding it (empty for a dense model)."""
        experts = {layout.expert for layout in self.layouts() if layout.expert is not None}
        if not experts:
            return {}
        return expert_senders(self.coords, self._sender_ranks(), self.cfg.actor.trainer.ep, len(experts))

    def weight_shards(self) -> list[dict[str, torch.Tensor]]:
        """`{megatron name: local tensor}` per weight sender (index = sender; beyond the TP ranks, experts only)."""
        tp = self.cfg.actor.trainer.tp
        refs = {i: self.actors[rank].weight_shards.remote(True, i >= tp) for i, rank in enumerate(self._sender_ranks())}
        return self._collect(refs, "weight_shards")

    # ---- weight sync, shard mode (`weight_sync.senders.ShardSenders`) -----------------------------

    def _senders(self) -> dict[int, Any]:
        """Sender index (= group rank) -> actor: TP ranks of data-parallel rank 0, then expert holders."""
        return {i: self.actors[rank] for i, rank in enumerate(self._sender_ranks())}

    def weight_group_endpoint(self) -> tuple[str, int]:
        """The weight-update group's rendezvous: TP rank 0's node address (or `cluster.advertise_address`) and
        a port free on that node."""
        sender = self._senders()[0]
        ref = sender.weight_group_endpoint.remote(self.cfg.cluster.advertise_address)
        return tuple(self._collect({0: ref}, "weight_group_endpoint", STRAGGLER_GRACE_S)[0])

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, key: str | None = None) -> None:
        """Every sender joins as group rank = its sender index; returns once all joined."""
        senders = self._senders()
        refs = {i: a.join_weight_group.remote(master_address, master_port, world_size, group_name, backend,
                                              timeout_s, key, i, len(senders)) for i, a in sorted(senders.items())}
        # A rank whose rendezvous fails raises within `timeout_s`; the margin covers the call itself.
        self._collect(refs, "join_weight_group", timeout_s + STRAGGLER_GRACE_S)

    def send_weight_bucket(self, schedules: Sequence[Any]) -> list[Any]:
        """Sender i sends `schedules[i]`; every sender's `SendStats` once all sends completed."""
        senders = self._senders()
        if len(schedules) != len(senders):
            raise ValueError(f"send_weight_bucket got {len(schedules)} schedules for {len(senders)} weight senders")
        return self._collect({tp: a.send_weight_bucket.remote(schedules[tp]) for tp, a in sorted(senders.items())},
                             "send_weight_bucket")

    def leave_weight_group(self) -> None:
        """Every sending rank leaves the group (idempotent; a gang that is not ready has nothing to leave)."""
        if self.state is not GroupState.READY:
            return
        self._collect({tp: a.leave_weight_group.remote() for tp, a in sorted(self._senders().items())},
                      "leave_weight_group")

    def probe_logprobs(self, sequences: Any) -> list[list[float]]:
        """Logprobs (nats) of each probe sequence's tokens after its prompt, under the current weights."""
        probe = TrainBatch.without_rollout(sequences.sequences, sequences.prompt_lens)
        return self._all("compute_logprobs", probe, "policy", False)

    def compute_logprobs(self, batch: TrainBatch, model: str = "policy") -> list[list[float]]:
        """Per sequence, logprobs (nats) of its response tokens under `model` (policy | reference | teacher)."""
        return self._all("compute_logprobs", batch, model)

    def train_step(self, batch: TrainBatch, distill_coef: float | None = None) -> dict[str, float]:
        """RL optimizer steps over the whole batch (split over data-parallel ranks); float stats.
        `distill_coef`: the distillation weight of this batch (None: `algo.distill_coef`)."""
        return self._all("train_step", batch, distill_coef)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """One supervised step on the response tokens (`lr` None: the RL schedule's current LR)."""
        return self._all("sft_step", batch, lr)

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF tensors gathered over TP (on CPU), from global rank 0."""
        return self._all("export_hf_state_dict")

    def offload(self, parts: tuple[str, ...], room: OverlapRoom | None = None) -> dict[str, float]:
        """Move `parts` of every rank's state to host memory; rank 0's bytes and seconds. With `room`, each rank
        decides for its own device whether its copies stay in flight; `deferred` says whether any rank's did."""
        if room is None:
            return self._all("offload", tuple(parts))
        answers = self._every("offload", tuple(parts), room)
        return {**answers[0], "deferred": max(a["deferred"] for a in answers)}

    def stage_offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        """Every rank copies `parts` to host memory ahead of their offload; rank 0's bytes and seconds."""
        return self._all("stage_offload", tuple(parts))

    def drop_staged(self, parts: tuple[str, ...]) -> None:
        """Every rank forgets the copies `stage_offload` made of `parts`."""
        self._all("drop_staged", tuple(parts))

    def finish_offload(self) -> dict[str, float]:
        """Every rank finishes its own offload in flight; rank 0's seconds."""
        return self._all("finish_offload")

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        """Bring offloaded `parts` back on every rank; rank 0's bytes and seconds."""
        return self._all("onload", tuple(parts))

    def device_memory(self, parts: bool = False) -> list[dict[str, float]]:
        """Every rank's device memory, in rank order (see `TrainerActor.device_memory`)."""
        return self._every("device_memory", parts)

    def memory_stats(self) -> dict[str, float]:
        """Rank 0's trainer memory (see `TrainerActor.memory_stats`)."""
        return self._all("memory_stats")

    def adapter_tensors(self) -> list[dict[str, torch.Tensor]]:
        """LoRA: the full adapter tensors under their PEFT names (gathered over TP), from global rank 0."""
        return [self._all("adapter_state")]

    def save_checkpoint(self, step: int, driver: DriverState, final: bool = False) -> SaveStats:
        """Every rank writes its own shards (rank 0 also the driver state and commits); rank 0's `SaveStats`."""
        self._require_ready()
        refs = {rank: a.save_checkpoint.remote(step, driver if rank == 0 else None, final)
                for rank, a in enumerate(self.actors)}
        return self._collect(refs, "save_checkpoint")[0]

    def finalize_checkpoint(self) -> SaveStats | None:
        """Wait on every rank for the save in flight to commit; rank 0's `SaveStats` (None: nothing saved)."""
        return self._all("finalize_checkpoint")

    def restore_checkpoint(self, path: str) -> DriverState | None:
        """Load checkpoint `path` on every rank (resharding to this TP/DP); the driver state it holds."""
        return self._all("restore_checkpoint", str(path))

    def state_dicts(self) -> list[dict[str, Any]]:
        """Checkpoint state of every rank, in global rank order."""
        self._require_ready()
        return self._collect({rank: a.state_dict.remote() for rank, a in enumerate(self.actors)}, "state_dict")

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Restore `states[rank]` on every rank (what `state_dicts` returned, same trainer.tp/dp)."""
        self._require_ready()
        if len(states) != self.world_size:
            raise ValueError(f"load_state_dicts got {len(states)} states for {self.world_size} trainer ranks "
                             "(trainer.tp * trainer.dp); restore with the layout they were saved with")
        self._collect({rank: a.load_state_dict.remote(states[rank]) for rank, a in enumerate(self.actors)},
                      "load_state_dict")
