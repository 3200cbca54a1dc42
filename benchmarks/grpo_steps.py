"""A few GRPO steps of the GSM8K recipe's shape, end to end through the driver, with the step-time breakdown,
the colocated hand-off's transitions and the GPU memory of each phase.

    python benchmarks/grpo_steps.py --engine-env PYTHONPATH=/opt/sglang-site:$PWD          # one GPU, bf16
    python benchmarks/grpo_steps.py --engine-env PYTHONPATH=/opt/sglang-site:$PWD trainer=gpu_fp8
    python benchmarks/grpo_steps.py --memory resident --async-steps 1        # both roles resident, one-step-off
    python benchmarks/grpo_steps.py --shape qwen2.5-7b --out 7b.json         # the whole Qwen2.5-7B, hand-off
    python benchmarks/grpo_steps.py --cpu                                    # the same path on CPU

GPU: `experiment=gsm8k_qwen2.5_0.5b` (SGLang engine, Megatron TE trainer, the seven rewards) with a random
checkpoint of `--shape`, synthetic GSM8K-format questions, and the trainer and the engine on one GPU
(`cluster.placement=colocated`). `--memory handoff` (the default, `cluster.colocated_memory=handoff`): the
trainer offloads `--offload` parts to pinned host memory while the engine generates, the engine releases its
weights and KV cache (SGLang's memory saver) while the trainer trains, and each push wakes it; `--memory
resident`: both keep their memory (the engine takes `--mem-fraction` of what is free when it starts). Weights
are pushed with `--transport` (default `ipc_handles`: CUDA IPC by driver handle into the engine's custom
weight loader, which works while trainer and SGLang run different torch builds; `disk`: safetensors on local
disk), every push verified by the probe. A random model earns no reward, so `algo.drop_zero_signal=false`
keeps every group in the batch (zero advantages still run the full forward/backward). Extra Hydra overrides
follow the flags.

Shapes and their defaults (each flag overrides its one):

- `qwen2.5-0.5b`: 64 prompts x 8 samples, 256 new tokens, `mem_fraction_static` 0.3, every part offloaded,
  the recipe's micro-batches (16384 tokens), the divergence guard on, a checkpoint every 2 steps.
- `qwen2.5-7b` (28 layers, hidden 3584, SwiGLU 18944, 28 heads, 4 KV heads, vocabulary 152064, untied; random
  bf16 weights made on the GPU): 16 prompts x 8 samples (128 sequences of <= ~250 prompt + 256 new tokens),
  256 new tokens, `mem_fraction_static` 0.2, micro-batches of 4096 tokens with full activation recompute,
  no divergence guard and no checkpoints. Full-parameter Adam at DP=1 (no distributed optimizer: it shards
  nothing over one rank) holds 137 GB: bf16 weights 15.2, fp32 gradient buffers 30.5, fp32 main weights 30.5,
  Adam moments 61; the guard would add a copy of the last three, a checkpoint would not fit on a 64 GiB disk.
  The weights and gradients (46 GB) go to host memory while the engine generates and the optimizer stays on
  the device (91 GB; offloading it too would pin 137 GB of the host's 128 GiB). SGLang 0.5.23 sizes its KV
  cache as what is free after loading its weights less (1 - mem_fraction_static) x what was free before: with
  0.2, ~8 GiB (~150k tokens), so at the push (optimizer, both copies of the weights and the KV cache on the
  device at once) ~15 GiB of the H200's 139 GiB stay free, and ~4 GiB at the training step's peak.

Prints one row per step as it lands: generate / reward / train / sync / checkpoint seconds, generation and
training tokens/s, the trainer-vs-engine |logp diff| of the batch and the weight-push probe's; then the
hand-off's transitions (`time/offload_seconds`, `time/engine_sleep_seconds`, `time/onload_seconds`,
`time/engine_wake_seconds`) and the memory at the end of each phase (`memory/<phase>_*`: the device memory
in use by every process, the trainer's peak allocation during the phase, the trainer state resident). Then
min / median / max of each over the steps after `--skip` warm-up steps (kernel compilation, first pinned
allocations). `--out` is rewritten after every step (and with the error if the run fails), so a run cut
short leaves the steps it finished. `--profile-push 12,13` records those steps' hand-over to the engines
(`Handoff.prepare_push` through `Handoff.push`, the checkpoint between them included) with the torch profiler, each
push phase and the trainer's probe scoring labelled: `<out>.push-profile/step-<N>.txt` (operators by host time,
then by device time) and `step-<N>.json.gz` (the timeline, for Perfetto); the figures leave those steps out.
There is no separate log-prob pass: with one optimizer step per batch the old-policy log-probs are the training
forward's own (detached), so recomputing them is part of "train".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from push_profile import PushProfiler
from train_step import SHAPES, make_model_dir

from miles_lite.config import load_config, validate
from miles_lite.config.offload import OFFLOAD_PARTS
from miles_lite.run.driver import train
from miles_lite.weight_sync.ipc_handles import LOADER as IPC_LOADER

PHASES = ("generate", "reward", "train", "sync", "checkpoint")
# The colocated hand-off's transitions (`miles_lite.run.handoff`), seconds per step.
TRANSITIONS = ("offload", "engine_sleep", "onload", "engine_wake")
# `memory/<phase>_<key>` (`Handoff.measure`), reported in GiB as `<phase>_<short>_gib`.
MEMORY_PHASES = ("generate", "train", "sync")
MEMORY_KEYS = {"device_used_bytes": "used", "trainer_peak_bytes": "peak", "trainer_state_bytes": "state"}
GIB = float(1 << 30)


@dataclass(frozen=True)
class Profile:
    """The defaults of one `--shape` (see the module docstring)."""

    prompts: int
    group_size: int
    new_tokens: int
    mem_fraction: float
    micro_batch_tokens: int | None  # None: the recipe's
    offload: str
    recompute: bool
    guard: bool
    checkpoint_interval: int | None  # None: no checkpoints at all
    steps: int
    skip: int


PROFILES = {
    "qwen2.5-0.5b": Profile(prompts=64, group_size=8, new_tokens=256, mem_fraction=0.3, micro_batch_tokens=None,
                            offload="params,grads,optimizer", recompute=False, guard=True, checkpoint_interval=2,
                            steps=4, skip=2),
    "qwen2.5-7b": Profile(prompts=16, group_size=8, new_tokens=256, mem_fraction=0.2, micro_batch_tokens=4096,
                          offload="params,grads", recompute=True, guard=False, checkpoint_interval=None,
                          steps=3, skip=1),
}
# Megatron's full activation recompute, one layer at a time (TransformerConfig fields, passed through).
RECOMPUTE = ["+trainer.transformer.recompute_granularity=full", "+trainer.transformer.recompute_method=uniform",
             "+trainer.transformer.recompute_num_layers=1"]


def step_list(spec: str) -> set[int]:
    """`--profile-push`: a comma list of step numbers (from 1)."""
    try:
        steps = {int(x) for x in spec.split(",") if x.strip()}
    except ValueError:
        steps = set()
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: give step numbers from 1, comma separated (e.g. 12,13)")
    return steps


def offload_parts(spec: str) -> tuple[str, ...]:
    """`--offload`: a comma list of `OFFLOAD_PARTS`, or `none`."""
    parts = tuple(p.strip() for p in spec.split(",") if p.strip())
    if parts == ("none",):
        return ()
    unknown = [p for p in parts if p not in OFFLOAD_PARTS]
    if unknown or not parts:
        raise ValueError(f"--offload {spec!r}: give a comma list of {', '.join(OFFLOAD_PARTS)}, or none")
    return parts


def overrides(args: argparse.Namespace, model_dir: Path | None, out_dir: Path) -> list[str]:
    """Hydra overrides of the recipe for a short run on random weights (`model_dir`: GPU runs only)."""
    common = [
        f"experiment.output_dir={out_dir}", f"experiment.steps={args.steps}",
        "experiment.warmup=none", "experiment.eval_size=0", "data=synthetic", "data.presample.enabled=false",
        "data.synthetic.train_size=2048", "data.synthetic.eval_size=0", "algo.drop_zero_signal=false",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.async_steps={args.async_steps}",
        f"cluster.colocated_memory={args.memory}",
    ]
    if args.checkpoint_interval is None:  # no checkpoint.dir: nothing is saved, not even at the end
        common += ["checkpoint.dir=''", "checkpoint.interval=0", "checkpoint.resume=none"]
    else:
        common += [f"checkpoint.interval={args.checkpoint_interval}", "checkpoint.async_save=true"]
    if args.cpu:
        return ["experiment=tiny_cpu", *common, "weight_sync.transport=disk", "rollout.prompts_per_step=4",
                "rollout.group_size=4"]
    env = [f"+rollout.engine_env.{k}='{v}'" for k, v in (kv.split("=", 1) for kv in args.engine_env)]
    common.append(f"weight_sync.transport={args.transport}")
    if args.transport == "ipc_handles":
        common.append(f"+rollout.sglang_args.custom_weight_loader=[{IPC_LOADER}]")
    parts = offload_parts(args.offload)
    trainer = [f"trainer.offload.{p}={str(p in parts).lower()}" for p in OFFLOAD_PARTS]
    # `--offload` names what moves every step (the recipe's own setting is `needed`): `trainer.offload.when=needed`
    # after the flags keeps what has room.
    trainer.append("trainer.offload.when=always")
    trainer.append("trainer.use_distributed_optimizer=false")  # DP=1: it would shard nothing
    if args.micro_batch_tokens is not None:
        trainer.append(f"trainer.micro_batch_tokens={args.micro_batch_tokens}")
    if not args.guard:
        trainer.append("trainer.max_update_ratio=0")
    if args.recompute:
        trainer += RECOMPUTE
    return ["experiment=gsm8k_qwen2.5_0.5b", f"model.hf_path={model_dir}", *common, "cluster.placement=colocated",
            f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group_size}",
            "rollout.sglang_args.base_gpu_id=0", f"rollout.sglang_args.mem_fraction_static={args.mem_fraction}",
            "weight_sync.max_probe_logp_diff=0.1", *trainer, *env]


def gpu_model_dir(shape_name: str, root: Path, init_std: float, device: str = "cuda") -> Path:
    """A random bf16 HF checkpoint of `shape_name`, made on `device` (a 7B one takes seconds on the GPU,
    minutes on the CPU) and saved under `root` once; the offline tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles_lite.data.tokenizer import load_or_build_tokenizer
    from miles_lite.trainer.tiny_hf import tiny_hf_config

    out = root / f"{shape_name}-std{init_std}-bf16"
    if not (out / "config.json").is_file():
        shape, vocab = SHAPES[shape_name]
        partial = Path(tempfile.mkdtemp(prefix=f".{shape_name}-", dir=root))  # renamed once complete
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(tiny_hf_config("qwen2", shape, vocab, init_std),
                                                     dtype=torch.bfloat16)
        model.save_pretrained(str(partial), safe_serialization=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()  # the trainer in this process and the engine take the GPU next
        partial.rename(out)
    if not (out / "tokenizer.json").is_file():
        load_or_build_tokenizer(root / ".tokenizers").save_pretrained(str(out))
    return out


def _gib(value: Any) -> float | None:
    return None if value is None else float(value) / GIB


def step_row(m: dict[str, Any]) -> dict[str, Any]:
    """One step's row from its metrics record."""
    row = {"step": m["step"], **{p: m.get(f"time/{p}_seconds", 0.0) for p in PHASES}}
    row.update(step_s=m.get("time/step_seconds"), train_tokens_per_s=m.get("tokens_per_s"),
               generate_tokens_per_s=m.get("rollout/tokens_per_second"),
               response_len=m.get("rollout/response_length_mean"),
               logp_abs_diff_mean=m.get("mismatch/logp_abs_diff_mean"),
               probe_logp_diff_mean=m.get("sync/probe_logp_diff_mean"), sync_gb_per_s=m.get("sync/gb_per_s"))
    row.update({f"{t}_s": m.get(f"time/{t}_seconds") for t in TRANSITIONS})
    row["offload_overlapped"] = m.get("time/offload_overlapped")
    # The push's own phases (weight_sync/coordinator.py): where the sync's seconds beyond the transitions go.
    row["sync_phases"] = {k.removeprefix("sync/phase_").removesuffix("_seconds"): v
                          for k, v in m.items() if k.startswith("sync/phase_")}
    for phase in MEMORY_PHASES:
        for key, short in MEMORY_KEYS.items():
            row[f"{phase}_{short}_gib"] = _gib(m.get(f"memory/{phase}_{key}"))
    return row


def read_rows(metrics: Path) -> list[dict[str, Any]]:
    """Per-step rows of a metrics.jsonl (a line still being written is left for the next read)."""
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if "step" in m and "time/train_seconds" in m:
            rows.append(step_row(m))
    return rows


def breakdown(run_dir: Path) -> list[dict[str, Any]]:
    """Per-step rows from the run's metrics.jsonl."""
    return read_rows(run_dir / "metrics.jsonl")


SPREAD_KEYS = (*PHASES, "step_s", *(f"{t}_s" for t in TRANSITIONS),
               *(f"{p}_{s}_gib" for p in MEMORY_PHASES for s in MEMORY_KEYS.values()))


def spread(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """min / median / max over `rows` of each phase's seconds, the step time, each transition's seconds,
    each memory figure and each of the push's own phases (`push_<phase>`; those the rows have)."""
    values = {key: [float(r[key]) for r in rows if r.get(key) is not None] for key in SPREAD_KEYS}
    for phase in dict.fromkeys(p for r in rows for p in r.get("sync_phases", {})):  # in push order
        values[f"push_{phase}"] = [r["sync_phases"][phase] for r in rows if phase in r.get("sync_phases", {})]
    return {key: {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)}
            for key, v in values.items() if v}


def print_row(r: dict[str, Any]) -> None:
    print(f"{r['step']:>4} " + " ".join(f"{r[p]:10.3f}" for p in PHASES)
          + f" {r['step_s'] or 0:8.3f} {r['generate_tokens_per_s'] or 0:10,.0f}"
          + f" {r['train_tokens_per_s'] or 0:11,.0f}"
          + f" {r['logp_abs_diff_mean'] or 0:9.4f} {r['probe_logp_diff_mean'] or 0:7.4f}", flush=True)
    moves = ", ".join(f"{t} {r[f'{t}_s']:.2f} s" for t in TRANSITIONS if r.get(f"{t}_s") is not None)
    if r.get("offload_overlapped") is not None:
        moves += f" (the optimizer's offload {'overlapped' if r['offload_overlapped'] else 'before'} the push)"
    memory = "; ".join(
        f"{p} " + "/".join("-" if r[f"{p}_{s}_gib"] is None else f"{r[f'{p}_{s}_gib']:.1f}"
                           for s in MEMORY_KEYS.values())
        for p in MEMORY_PHASES if any(r.get(f"{p}_{s}_gib") is not None for s in MEMORY_KEYS.values()))
    if moves or memory:
        print(f"     hand-off: {moves or 'none'}; GiB used/trainer peak/trainer state: {memory or '-'}", flush=True)
    if r.get("sync_phases"):
        print("     push: " + ", ".join(f"{k} {v:.3f} s" for k, v in r["sync_phases"].items()), flush=True)


class StepReport:
    """The result file, rewritten after every step the run logs (a background reader of its metrics.jsonl)."""

    def __init__(self, out_dir: Path, out: Path | None, skip: int, meta: dict[str, Any],
                 profiled: Collection[int] = ()) -> None:
        self.out_dir, self.out, self.skip, self.profiled = out_dir, out, skip, profiled
        self.started = time.monotonic()
        self.result: dict[str, Any] = {**meta, "status": "running", "steps": [], "spread": {}}
        self.printed = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="grpo-steps-report", daemon=True)

    def start(self) -> None:
        self.write()
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(2.0):
            self.update()

    def update(self, run_dir: Path | None = None) -> None:
        """Read the run's metrics (`run_dir`, else the one under the output directory), print the new rows and
        rewrite the result file."""
        with self._lock:
            found = [run_dir / "metrics.jsonl"] if run_dir else sorted(self.out_dir.glob("*/metrics.jsonl"))
            rows = read_rows(found[0]) if found and found[0].is_file() else []
            if len(rows) <= self.printed:
                return
            if self.printed == 0:
                # Where a part's time goes before its first step: the model made, the run's start-up, step 1.
                self.result["first_step_logged_s"] = round(time.monotonic() - self.started, 1)
                first = rows[0].get("step_s")
                print(f"first step logged {self.result['first_step_logged_s']:.0f} s after the benchmark started "
                      f"(the run started at {self.result.get('run_started_s', 0.0):.0f} s"
                      + (f"; step {rows[0]['step']} took {first:.1f} s)" if first is not None else ")"), flush=True)
                print(f"{'step':>4} " + " ".join(f"{p:>10}" for p in PHASES)
                      + f" {'step s':>8} {'gen tok/s':>10} {'train tok/s':>11} {'logp diff':>9} {'probe':>7}")
            for r in rows[self.printed:]:
                print_row(r)
            self.printed = len(rows)
            # The profiled steps ran under the profiler: left out of the figures.
            measured = [r for r in rows[self.skip:] if r["step"] not in self.profiled]
            self.result.update(steps=rows, spread=spread(measured))
            self.write()

    def finish(self, status: str, run_dir: Path | None = None) -> None:
        """Stop watching, take the last rows and write the result with `status`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.update(run_dir)
        with self._lock:
            self.result["status"] = status
            if run_dir is not None:
                self.result["run_dir"] = str(run_dir)
            self.write()

    def write(self) -> None:
        if self.out is None:
            return
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        os.replace(tmp, self.out)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The flags, with the `--shape` profile's defaults filled in, and the extra Hydra overrides."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny model, reference engines, CPU trainer")
    p.add_argument("--shape", choices=sorted(PROFILES), default=None,
                   help="the model's shape (GPU; default qwen2.5-0.5b); sets the defaults of the flags below")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--skip", type=int, default=None, help="warm-up steps left out of the min/median/max summary")
    p.add_argument("--memory", choices=("handoff", "resident"), default="handoff",
                   help="cluster.colocated_memory: hand the GPU over between the roles, or both keep their memory")
    p.add_argument("--prompts", type=int, default=None, help="rollout.prompts_per_step")
    p.add_argument("--group-size", type=int, default=None, help="rollout.group_size")
    p.add_argument("--new-tokens", type=int, default=None, help="rollout.max_new_tokens")
    p.add_argument("--mem-fraction", type=float, default=None, help="SGLang's mem_fraction_static")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="trainer.micro_batch_tokens")
    p.add_argument("--offload", default=None, metavar="PARTS",
                   help=f"trainer.offload parts in a hand-off ({','.join(OFFLOAD_PARTS)} or none)")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron's full activation recompute")
    p.add_argument("--guard", action=argparse.BooleanOptionalAction, default=None,
                   help="the divergence guard (off: trainer.max_update_ratio=0)")
    p.add_argument("--checkpoint-interval", type=int, default=None,
                   help="steps between checkpoints (0: only the final one)")
    p.add_argument("--no-checkpoint", action="store_true", help="save no checkpoint at all")
    p.add_argument("--async-steps", type=int, default=0, help="rollout.async_steps (1: one-step-off; resident only)")
    p.add_argument("--transport", default="ipc_handles", choices=("ipc_handles", "ipc", "disk", "distributed"))
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--model-root", type=Path, default=Path("/tmp/miles-bench-models"))
    p.add_argument("--out", type=Path, default=None, help="result JSON, rewritten after every step")
    p.add_argument("--profile-push", type=step_list, default=set(), metavar="STEPS",
                   help="comma list of steps whose hand-over to the engines the torch profiler records")
    args, extra = p.parse_known_args(argv)
    if args.cpu and args.shape is not None:
        p.error("--shape is for GPU runs; --cpu runs the tiny CPU model")
    profile = PROFILES[args.shape or "qwen2.5-0.5b"]
    for name in ("prompts", "group_size", "new_tokens", "mem_fraction", "micro_batch_tokens", "offload",
                 "recompute", "guard", "steps", "skip"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(profile, name))
    if args.no_checkpoint:
        args.checkpoint_interval = None
    elif args.checkpoint_interval is None:
        args.checkpoint_interval = profile.checkpoint_interval
    try:
        offload_parts(args.offload)
    except ValueError as exc:
        p.error(str(exc))
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    out_dir = Path(tempfile.mkdtemp(prefix="grpo-steps-"))
    shape = "tiny_cpu" if args.cpu else args.shape or "qwen2.5-0.5b"
    report = StepReport(out_dir, args.out, args.skip, {"shape": shape, "memory": args.memory}, args.profile_push)
    report.start()
    run_dir = None
    try:
        if args.cpu:
            model_dir = None
        elif args.shape == "qwen2.5-7b":
            args.model_root.mkdir(parents=True, exist_ok=True)
            model_dir = gpu_model_dir(args.shape, args.model_root, 0.02)
        else:
            model_dir = make_model_dir(args.shape or "qwen2.5-0.5b", args.model_root, 0.02)
        over = overrides(args, model_dir, out_dir) + extra
        report.result["overrides"] = over
        print("overrides: " + " ".join(over), flush=True)
        cfg = load_config(over)
        validate(cfg)
        if args.profile_push:
            out = args.out or out_dir / "grpo-steps.json"
            PushProfiler(args.profile_push, out.with_name(out.stem + ".push-profile")).install()
        report.result["run_started_s"] = round(time.monotonic() - report.started, 1)
        summary = train(cfg)
        run_dir = Path(summary.run_dir)
    except BaseException as exc:
        report.finish(f"failed: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1
    report.finish("done", run_dir)
    stats = report.result["spread"]
    if stats:
        print(f"over steps {args.skip + 1}..{len(report.result['steps'])} (median (min-max)):", flush=True)
        for key, v in stats.items():
            print(f"  {key:>20} {v['median']:9.3f} ({v['min']:.3f}-{v['max']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
