"""Build the configured weight-sync path (transport + verifier + coordinator) for a trainer role, from the
`WeightSyncSetup` view the run layer builds."""

from __future__ import annotations

from pathlib import Path

from miles_lite.config.views import WeightSyncSetup
from miles_lite.weight_sync.buckets import bucket_bytes_limit
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator
from miles_lite.weight_sync.layouts import specs_from_layouts
from miles_lite.weight_sync.senders import WeightSource
from miles_lite.weight_sync.transport import EngineLoop, WeightTransport
from miles_lite.weight_sync.verify import PushVerifier, make_probe


def build_transport(cfg: WeightSyncSetup, trainer: WeightSource, loop: EngineLoop, run_dir: Path,
                    api_key: str | None = None) -> WeightTransport:
    """The transport `weight_sync.transport` names, over the trainer's parameter layouts; a weight-update group
    admits only ranks presenting `api_key` (except SGLang's own group: full mode on SGLang engines)."""

    ws = cfg.weight_sync
    if cfg.adapters is not None:
        from miles_lite.trainer.lora import lora_spec
        from miles_lite.weight_sync.adapter_push import AdapterTransport

        spec = lora_spec(cfg.adapters)
        assert spec is not None
        root = Path(ws.disk_dir) if ws.disk_dir else run_dir / "adapters"
        return AdapterTransport(spec, root, loop, base_model=cfg.base_model, via=ws.lora)
    # Dense tensors are resharded from the TP ranks; each routed expert comes whole from a sender on its EP rank.
    specs = specs_from_layouts(trainer.layouts(), cfg.dtype, trainer.expert_senders())
    if ws.transport == "disk":
        from miles_lite.weight_sync.disk import DiskTransport

        root = Path(ws.disk_dir) if ws.disk_dir else run_dir / "weights"
        return DiskTransport(specs, cfg.trainer_tp, root, loop, bucket_bytes=bucket_bytes_limit(ws.bucket_mib))
    if ws.transport == "distributed":
        from miles_lite.net.ports import LOCAL_HOST, node_address, url_host
        from miles_lite.weight_sync.distributed import DistributedTransport

        backend = cfg.collective_backend
        sglang_group = ws.mode == "full" and cfg.engine_backend == "sglang"
        # Full mode hosts the group in this process (the driver); shard mode asks the trainer's TP rank 0.
        master = node_address(cfg.advertise_address, [url_host(u) for u in cfg.engine_urls],
                              fallback=LOCAL_HOST)
        return DistributedTransport(specs, cfg.trainer_tp, loop, bucket_bytes=bucket_bytes_limit(ws.bucket_mib),
                                    mode=ws.mode, backend=backend, init_timeout_s=ws.init_timeout_s,
                                    master_address=master, device="cuda" if backend == "nccl" else "cpu",
                                    senders=trainer if ws.mode == "shard" else None,
                                    group_key=None if sglang_group else api_key, engine_warm_up=not sglang_group)
    if ws.transport == "ipc_handles":
        from miles_lite.weight_sync.ipc_handles import IpcHandleTransport

        return IpcHandleTransport(specs, cfg.trainer_tp, loop, bucket_bytes=bucket_bytes_limit(ws.bucket_mib))
    from miles_lite.weight_sync.ipc import IpcTransport

    return IpcTransport(specs, cfg.trainer_tp, loop, bucket_bytes=bucket_bytes_limit(ws.bucket_mib))


def build_coordinator(cfg: WeightSyncSetup, trainer: WeightSource, loop: EngineLoop,
                      run_dir: Path, api_key: str | None = None) -> WeightSyncCoordinator:
    """Transport plus, when `weight_sync.verify`, a probe verifier scoring a fixed batch on both sides."""
    ws = cfg.weight_sync
    transport = build_transport(cfg, trainer, loop, run_dir, api_key)
    verifier = None
    if ws.verify:
        probe = make_probe(cfg.vocab_size, ws.probe_sequences, ws.probe_tokens, seed=cfg.seed)
        verifier = PushVerifier(loop, probe, trainer.probe_logprobs, max_probe_logp_diff=cfg.probe_bound,
                                bound_note=cfg.probe_bound_note)
    return WeightSyncCoordinator(transport, loop, verifier)
