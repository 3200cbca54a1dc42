"""A few GRPO steps of the GSM8K recipe's shape, end to end through the driver, with the step-time breakdown.

    python benchmarks/grpo_steps.py --engine-env PYTHONPATH=/opt/sglang-site:$PWD          # one GPU, bf16
    python benchmarks/grpo_steps.py --engine-env PYTHONPATH=/opt/sglang-site:$PWD trainer=gpu_fp8
    python benchmarks/grpo_steps.py --engine-env PYTHONPATH=/opt/sglang-site:$PWD --async-steps 1
    python benchmarks/grpo_steps.py --cpu                                                  # the same path on CPU

GPU: `experiment=gsm8k_qwen2.5_0.5b` (SGLang engine, Megatron TE trainer, the seven rewards, group size 8,
64 prompts a step) with a random Qwen2.5-0.5B-shaped checkpoint, synthetic GSM8K-format questions, the
trainer and the engine on the same GPU (the engine takes `mem_fraction_static` of it), weights pushed with
`--transport` (default `ipc_handles`: CUDA IPC by driver handle into the engine's custom weight loader,
which works while trainer and SGLang run different torch builds; `disk`: safetensors on local disk),
every push verified by the probe, and an asynchronous checkpoint every `--checkpoint-interval` steps.
A random model earns no reward, so `algo.drop_zero_signal=false` keeps every group in the batch (zero
advantages still run the full forward/backward). Extra Hydra overrides follow the flags.
Prints one row per step: generate / reward / train / sync / checkpoint seconds, generation and training
tokens/s, the trainer-vs-engine |logp diff| of the batch and the weight-push probe's; then min / median /
max of each phase over the steps after `--skip` warm-up steps (kernel compilation, first FP8 scaling).
There is no separate log-prob pass: with one optimizer step per batch the old-policy log-probs are the
training forward's own (detached), so recomputing them is part of "train".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from train_step import make_model_dir

from miles_lite.config import load_config, validate
from miles_lite.driver import train
from miles_lite.weight_sync.ipc_handles import LOADER as IPC_LOADER

PHASES = ("generate", "reward", "train", "sync", "checkpoint")


def overrides(args: argparse.Namespace, model_dir: Path | None, out_dir: Path) -> list[str]:
    """Hydra overrides of the recipe for a short run on random weights (`model_dir`: GPU runs only)."""
    common = [
        f"experiment.output_dir={out_dir}", f"experiment.steps={args.steps}",
        "experiment.warmup=none", "experiment.eval_size=0", "data=synthetic", "data.presample.enabled=false",
        "data.synthetic.train_size=2048", "data.synthetic.eval_size=0", "algo.drop_zero_signal=false",
        f"checkpoint.interval={args.checkpoint_interval}", "checkpoint.async_save=true",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.async_steps={args.async_steps}",
    ]
    if args.cpu:
        return ["experiment=tiny_cpu", *common, "weight_sync.transport=disk", "rollout.prompts_per_step=4",
                "rollout.group_size=4"]
    env = [f"+rollout.engine_env.{k}='{v}'" for k, v in (kv.split("=", 1) for kv in args.engine_env)]
    common.append(f"weight_sync.transport={args.transport}")
    if args.transport == "ipc_handles":
        common.append(f"+rollout.sglang_args.custom_weight_loader=[{IPC_LOADER}]")
    return ["experiment=gsm8k_qwen2.5_0.5b", f"model.hf_path={model_dir}", *common, "cluster.placement=colocated",
            "rollout.sglang_args.base_gpu_id=0", f"rollout.sglang_args.mem_fraction_static={args.mem_fraction}",
            "weight_sync.max_probe_logp_diff=0.1", *env]


def breakdown(run_dir: Path) -> list[dict[str, Any]]:
    """Per-step phase seconds and throughput from the run's metrics.jsonl."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "step" not in m or "time/train_seconds" not in m:
            continue
        row = {"step": m["step"] + 1, **{p: m.get(f"time/{p}_seconds", 0.0) for p in PHASES}}
        row.update(step_s=m.get("time/step_seconds"), train_tokens_per_s=m.get("tokens_per_s"),
                   generate_tokens_per_s=m.get("rollout/tokens_per_second"),
                   response_len=m.get("rollout/response_length_mean"),
                   logp_abs_diff_mean=m.get("mismatch/logp_abs_diff_mean"),
                   probe_logp_diff_mean=m.get("sync/probe_logp_diff_mean"), sync_gb_per_s=m.get("sync/gb_per_s"))
        rows.append(row)
    return rows


def spread(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """min / median / max of each phase's seconds and of the step time over `rows`."""
    import statistics

    out = {}
    for key in (*PHASES, "step_s"):
        vals = sorted(float(r[key] or 0.0) for r in rows)
        if vals:
            out[key] = {"min": vals[0], "median": statistics.median(vals), "max": vals[-1], "n": len(vals)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny model, reference engines, CPU trainer")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the min/median/max summary")
    p.add_argument("--async-steps", type=int, default=0, help="rollout.async_steps (1: one-step-off)")
    p.add_argument("--transport", default="ipc_handles", choices=("ipc_handles", "ipc", "disk", "distributed"))
    p.add_argument("--checkpoint-interval", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--mem-fraction", type=float, default=0.3)
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--model-root", type=Path, default=Path("/tmp/miles-bench-models"))
    p.add_argument("--out", type=Path, default=None)
    args, extra = p.parse_known_args(argv)
    out_dir = Path(tempfile.mkdtemp(prefix="grpo-steps-"))
    model_dir = None if args.cpu else make_model_dir("qwen2.5-0.5b", args.model_root, 0.02)
    over = overrides(args, model_dir, out_dir) + extra
    cfg = load_config(over)
    validate(cfg)
    summary = train(cfg)
    rows = breakdown(Path(summary.run_dir))
    print(f"{'step':>4} " + " ".join(f"{p:>10}" for p in PHASES)
          + f" {'step s':>8} {'gen tok/s':>10} {'train tok/s':>11} {'logp diff':>9} {'probe':>7}")
    for r in rows:
        print(f"{r['step']:>4} " + " ".join(f"{r[p]:10.3f}" for p in PHASES)
              + f" {r['step_s'] or 0:8.3f} {r['generate_tokens_per_s'] or 0:10,.0f}"
              + f" {r['train_tokens_per_s'] or 0:11,.0f}"
              + f" {r['logp_abs_diff_mean'] or 0:9.4f} {r['probe_logp_diff_mean'] or 0:7.4f}")
    stats = spread(rows[args.skip:])
    if stats:
        print(f"over steps {args.skip + 1}..{len(rows)}: " + "; ".join(
            f"{k} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for k, v in stats.items()))
    result = {"overrides": over, "run_dir": summary.run_dir, "steps": rows, "spread": stats}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
