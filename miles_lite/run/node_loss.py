"""How a Ray run ends when its cluster loses a node: one line naming the node, the step and the checkpoint a rerun
resumes from; the traceback goes to the run's log file; the process exits with `EXIT_NODE_LOST`.

A lost node shows up in the run as whatever failed first: the fleet running out of engines (`FleetExhausted`
once the replacements of the node's engines found no room), a trainer actor that died, a push that failed.
`NodeWatch` records the cluster's nodes when the run starts; when the run fails, the ones Ray now reports dead
are named, with the role their resources say they served (`cluster.trainer_resource` / `rollout_resource`).
The step that failed is not checkpointed; a save already in flight is let commit when the trainer's nodes are
alive. A rerun of the same command (`checkpoint.resume=auto`) resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any

from miles_lite.checkpoint.resume import newest_complete
from miles_lite.config.schema import ClusterConfig
from miles_lite.formats.files import append_line
from miles_lite.observability.run_log import RUN_LOG

# Exit status of `miles-lite train` when the run's Ray cluster lost a node (0 done, 2 bad input, 3 halted by a
# guard, 4 a plug-in failed).
EXIT_NODE_LOST = 5
# Seconds a failed run waits for Ray's verdict on its nodes. Ray's GCS declares a node dead after 5 failed health
# checks 3 s apart (its defaults): about 15 s after the node went. The run's failure can come well before that:
# a request retried on the lost node's engines runs out of retries in milliseconds (connections refused), a
# trainer actor's death surfaces at once; a replacement engine that waits for room comes after it.
DEAD_NODE_GRACE_S = 25.0

logger = logging.getLogger(__name__)


class RunEndedByNodeLoss(RuntimeError):
    """The run ended because its Ray cluster lost a node; the message is the one line the console shows."""


@dataclass(frozen=True)
class LostNode:
    node_id: str
    address: str
    role: str

    def describe(self) -> str:
        return f"Ray node {self.address} ({self.role}, node id {self.node_id[:12]})"


@dataclass
class NodeWatch:
    """The Ray nodes alive when the run started: node id -> (address, role)."""

    nodes: dict[str, tuple[str, str]]

    @classmethod
    def capture(cls, cluster: ClusterConfig) -> NodeWatch | None:
        """The alive nodes of the Ray cluster this process is connected to (None when it is not)."""
        try:
            import ray

            if not ray.is_initialized():
                return None
            return cls({n["NodeID"]: (n["NodeManagerAddress"], _role(n.get("Resources") or {}, cluster))
                        for n in ray.nodes() if n.get("Alive")})
        except Exception as exc:  # no Ray, or its GCS does not answer: nothing to watch
            logger.warning("cannot list the Ray cluster's nodes (%r): a lost node will not be named", exc)
            return None

    def lost(self, grace_s: float = DEAD_NODE_GRACE_S) -> list[LostNode]:
        """The recorded nodes Ray reports dead now, waiting up to `grace_s` for its verdict (empty: none)."""
        import ray

        deadline = time.monotonic() + grace_s
        while True:
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            except Exception as exc:  # the GCS is gone (the head node was lost): nothing can be named
                logger.warning("cannot list the Ray cluster's nodes after the failure: %r", exc)
                return []
            dead = [LostNode(nid, addr, role) for nid, (addr, role) in self.nodes.items() if nid not in alive]
            # A node Ray still lists as alive may be one whose health checks have not concluded yet.
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(1.0)  # the poll period of Ray's verdict on its nodes


def _role(resources: dict[str, float], cluster: ClusterConfig) -> str:
    roles = [name for name, key in (("trainer", cluster.trainer_resource), ("rollout", cluster.rollout_resource))
             if key and resources.get(key)]
    return " and ".join(roles) or "shared by both roles"


def end_on_node_loss(system: Any, io: Any, summary: Any, error: BaseException, lost: list[LostNode],
                     start: float) -> RunEndedByNodeLoss:
    """Let a save in flight commit (unless a trainer node is gone), log the traceback, write `summary.json`;
    returns the exception whose message is the console's one line."""
    cfg = system.cfg
    if cfg.checkpoint.dir and not any("trainer" in n.role for n in lost):
        try:
            system.trainer.finalize_checkpoint()
        except Exception as exc:  # the save in flight failed too: the newest committed one stays the resume point
            logger.warning("the checkpoint in flight did not commit: %r", exc)
    resume = newest_complete(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    path = io.run_dir / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    nodes = ", ".join(n.describe() for n in lost)
    step = f"step {summary.steps_done + 1}/{cfg.experiment.steps}"
    cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    append_line(path, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {nodes} lost at {step}\n"
                      f"{''.join(traceback.format_exception(error))}")
    summary.stopped_reason = f"{nodes} lost at {step}"
    summary.node_loss = {"nodes": [n.__dict__ for n in lost], "step": summary.steps_done + 1,
                         "error": cause, "log": str(path), "resume_from": str(resume) if resume else None}
    summary.wall_seconds = time.perf_counter() - start
    io.finish(summary, quiet=True)
    point = (f"the run resumes from {resume} (run the same command again)" if resume
             else "no checkpoint was committed: the run starts over")
    return RunEndedByNodeLoss(f"{nodes} was lost at {step} ({cause}; traceback in {path}); {point}")
