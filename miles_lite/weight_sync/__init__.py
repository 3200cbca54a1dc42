"""TP-aware weight sync from the Megatron trainer to the rollout engines.

`plan` (pure reshard plan) -> `buckets` -> a transport (`distributed`, `disk`, `ipc`) behind the
`transport.WeightTransport` seam, driven by `coordinator.WeightSyncCoordinator` and checked by
`verify.PushVerifier`. `sglang_payloads` builds SGLang's weight-update request bodies.
A role: it may import the trainer's layouts, the rollout client's engine seam and the libraries, never an
engine server nor the run layer.
"""

from miles_lite.weight_sync.plan import EngineSpec, ParamSpec, PlanError, ReshardPlan, apply_plan, build_plan
from miles_lite.weight_sync.transport import FleetEngine, PushReport, WeightSyncError, WeightTransport

__all__ = [
    "EngineSpec",
    "FleetEngine",
    "ParamSpec",
    "PlanError",
    "PushReport",
    "ReshardPlan",
    "WeightSyncError",
    "WeightTransport",
    "apply_plan",
    "build_plan",
]
