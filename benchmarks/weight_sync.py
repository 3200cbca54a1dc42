"""Seconds, bytes and GB/s of one weight push per transport, from the real trainer gang into reference engines.

    .venv/bin/python benchmarks/weight_sync.py [--hidden 1024 --ffn 2816 --layers 4 --vocab 32000]
        [--trainer-tp 2] [--engines 2] [--bucket-mib 64] [--repeats 2] [--dir DIR]

Builds a random Qwen2-shaped model (about 320 MB in fp32 with the defaults), starts the trainer as a
TP=`--trainer-tp` Ray gang (`RayTrainerGroup`) and `--engines` reference-engine processes (TP=1),
then pushes the trainer's weights through each transport: distributed full (trainer shards gathered
into the driver, HF tensors broadcast over gloo), distributed shard (the trainer ranks join the group
and send each engine rank its slices, point to point; nothing is gathered) and disk (safetensors +
`/update_weights_from_disk`). Every push is verified (probe logprobs). Per transport
it prints the phases of the last of `--repeats` pushes: gather (trainer shards into the driver),
convert (reshard plan: slicing and casting, on the trainer ranks in shard mode), transfer, load
(engines load and acknowledge), verify (probe scoring before
and after) and the rest of the pause window (pause, flush, version check, resume), plus
bytes moved and GB/s over transfer + load. The first push of each transport also builds its group.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from miles_lite.cluster.ray_trainer import RayTrainerGroup
from miles_lite.config.schema import MilesConfig, RolloutConfig, TinyModelShape
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.net.ports import LOCAL_HOST
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.trainer.tiny_hf import make_tiny_hf_model
from miles_lite.weight_sync.buckets import MIB
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator
from miles_lite.weight_sync.disk import DiskTransport
from miles_lite.weight_sync.distributed import DistributedTransport
from miles_lite.weight_sync.layouts import specs_from_layouts
from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, WeightTransport
from miles_lite.weight_sync.verify import PushVerifier, make_probe

CHECKSUM = ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight")
COLUMNS = ("gather", "convert", "transfer", "load", "verify", "other")


@dataclass
class Row:
    """One transport's figures (seconds; bytes moved; first push wall including group set-up)."""

    transport: str
    seconds: dict[str, float]
    bytes: int
    buckets: int
    gb_per_s: float
    first_wall_s: float
    wall_s: float
    probe_diff: float


def trainer_config(model_dir: Path, tp: int) -> MilesConfig:
    cfg = MilesConfig()
    cfg.model.hf_path = str(model_dir)
    cfg.trainer.tp = tp
    cfg.trainer.device, cfg.trainer.layer_spec, cfg.trainer.precision = "cpu", "local", "fp32"
    return cfg


def run_transport(name: str, transport: WeightTransport, loop: EngineLoop, fleet: list[FleetEngine],
                  trainer: RayTrainerGroup, new: dict, repeats: int) -> Row:
    """Push `repeats` times through `transport`; figures of the last push."""
    probe = make_probe(len(new["model.embed_tokens.weight"]), sequences=2, tokens=16, seed=0)
    verifier = PushVerifier(loop, probe, trainer.probe_logprobs, max_probe_logp_diff=1e-3)
    sync = WeightSyncCoordinator(transport, loop, verifier)
    walls = []
    try:
        for i in range(repeats):
            start = time.perf_counter()
            report = sync.push(fleet, trainer.weight_shards, f"{name.replace('/', '-')}-{i}")
            walls.append(time.perf_counter() - start)
    finally:
        sync.close()
    seconds = dict(report.push.seconds)
    seconds["verify"] = walls[-1] - report.paused_s
    seconds["other"] = report.paused_s - report.push.total_seconds
    assert report.verify is not None
    return Row(name, seconds, report.push.bytes, report.push.buckets, report.push.gb_per_s, walls[0], walls[-1],
               report.verify.logp_diff_max)


def print_table(rows: list[Row]) -> None:
    head = "| transport | MB moved | buckets | " + " | ".join(f"{c} s" for c in COLUMNS) + \
        " | push wall s | GB/s (transfer+load) | first push s |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        cells = [r.transport, f"{r.bytes / 1e6:.1f}", str(r.buckets), *(f"{r.seconds[c]:.3f}" for c in COLUMNS),
                 f"{r.wall_s:.3f}", f"{r.gb_per_s:.3f}", f"{r.first_wall_s:.3f}"]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--trainer-tp", type=int, default=2)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    root = args.dir or Path(tempfile.mkdtemp(prefix="miles-wsync-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    shape = TinyModelShape(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_layers=args.layers,
                           num_attention_heads=args.heads, num_kv_heads=args.kv_heads, max_position_embeddings=64)
    model_dir = make_tiny_hf_model("qwen2", shape, args.vocab, root / "model", seed=0)
    launcher = EngineLauncher(RolloutConfig(backend="reference", engines=args.engines, startup_timeout_s=900),
                              str(model_dir), str(root / "logs"))
    loop_thread = EventLoopThread("wsync-bench").start()
    trainer = None
    engines = []
    try:
        t0 = time.perf_counter()
        trainer = RayTrainerGroup.start(trainer_config(model_dir, args.trainer_tp))
        print(f"trainer gang (tp={args.trainer_tp}) up in {time.perf_counter() - t0:.1f} s")

        async def start_all():
            return await asyncio.gather(*(launcher.start(i) for i in range(args.engines)))

        t0 = time.perf_counter()
        engines = loop_thread.run(start_all())
        print(f"{args.engines} reference engines up in {time.perf_counter() - t0:.1f} s")
        loop = EngineLoop(loop_thread.loop, timeout_s=1800)
        fleet = [FleetEngine(e.client, EngineSpec(e.client.engine_id, 1, vocab_pad_to=1)) for e in engines]
        specs = specs_from_layouts(trainer.layouts(), "float32")
        new = trainer.export_hf_state_dict()
        total = sum(t.numel() * t.element_size() for t in new.values())
        print(f"model: {len(new)} HF tensors, {total / 1e6:.1f} MB fp32; trainer tp={args.trainer_tp}, "
              f"{args.engines} engines (tp=1), buckets of {args.bucket_mib} MiB\n")
        bucket = args.bucket_mib * MIB
        rows = []
        for mode in ("full", "shard"):
            transport = DistributedTransport(specs, args.trainer_tp, loop, bucket_bytes=bucket, mode=mode,
                                             backend="gloo", group_name=f"bench_{mode}", init_timeout_s=300,
                                             senders=trainer if mode == "shard" else None,
                                             master_address=LOCAL_HOST)
            rows.append(run_transport(f"distributed/{mode}", transport, loop, fleet, trainer, new, args.repeats))
        disk = DiskTransport(specs, args.trainer_tp, root / "weights", loop, bucket_bytes=bucket, keep_versions=1,
                             template_dir=model_dir)
        rows.append(run_transport("disk", disk, loop, fleet, trainer, new, args.repeats))
        print_table(rows)
        print("\nprobe |logp diff| max per transport: " + ", ".join(f"{r.transport} {r.probe_diff:.2e}" for r in rows))
    finally:
        for e in engines:
            loop_thread.run(launcher.stop(e))
        loop_thread.stop()
        if trainer is not None:
            trainer.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
