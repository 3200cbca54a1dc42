"""miles-lite against TRL's GRPOTrainer on the same work: the letters task (reverse three letters), the same
tiny weights, prompts, reward and settings, run in interleaved rounds.

    python benchmarks/peer_trl.py                          # 6 rounds of 150 GRPO steps, one thread each
    python benchmarks/peer_trl.py --pairs 8 --steps 60     # other counts
    python benchmarks/peer_trl.py --variants miles         # TRL against synchronous miles-lite only
    python benchmarks/peer_trl.py --threads 2              # TRL (and each miles-lite process) on 2 threads
    python benchmarks/peer_trl.py --table DIR/peer_trl.json   # the tables of a saved run

Setup (once per invocation, or `--base DIR`): the weights both start from are the letters experiment's SFT
warm-up (`miles-lite train experiment=letters_cpu experiment.steps=0`, 300 steps on 48 reference answers),
converted to a transformers directory (`miles-lite convert --to-hf`): a model the project builds offline,
loaded by `AutoModelForCausalLM` in TRL and by miles-lite's trainer and engine. The 384 training and 128
held-out prompts are written once as TRL's conversational records (`{"prompt": [{"role": "user", ...}],
"label": ...}`), read unchanged by both (`datasets.Dataset.from_json`, `data.source=records`), rendered by the
same chat template. The reward is one function in TRL's convention (`reversed_letters` below: exact answer 1.0,
else partial credit), passed to TRL's `reward_funcs` and to miles-lite's `rewards.custom` alike.

Settings, both sides: 8 prompts x 8 completions a step, at most 12 new tokens, temperature 1, learning rate
5e-4 (5 warm-up steps, cosine to 5e-5), AdamW betas (0.9, 0.98), gradient clip 1.0, no KL, clip range
0.2 / 0.28, token-mean loss over every completion token, advantages normalised by the group's std, one
optimizer step per batch. miles-lite runs on one reference engine (`rollout.engines=1`) with evaluation and
presampling off (the benchmark evaluates), twice a round: with synchronous rollouts (`rollout.async_steps=0`:
each step generates on the weights it trains, as TRL does) and one-step-off (`rollout.async_steps=1`: the next
step generates while this one trains; `--variants` picks). Every process gets `OMP_NUM_THREADS=--threads`;
miles-lite's trainer and engine use one torch thread each (their defaults).

Each round runs TRL and the miles-lite variants one after the other (the order rotates), each as a user would
start it (a fresh process), round i with seed i. From each run's output, stamped as it arrives: launch to the
end of the first step, each later step's wall time (median per run), the CPU seconds its processes spent per
step, completion tokens per second of step time, and launch to exit. Held-out accuracy: every final model
decodes the 128 held-out prompts greedily with the same transformers code (exact reversal). Printed per round,
then for each miles-lite variant min/median/max against TRL's and of the per-round ratios to TRL, and the
accuracies' difference in standard errors. Goals: step time <= 0.8x TRL's, time to the first step <= TRL's,
held-out accuracy equal within 2 standard errors. The 1-minute load average is printed before and after: on a
shared machine, compare only interleaved numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LETTERS = ROOT / "examples" / "tasks" / "letters"
PROMPTS_PER_STEP, GROUP, MAX_NEW, LR, MIN_LR, WARMUP = 8, 8, 12, 5e-4, 5e-5, 5
GOAL_STEP_RATIO, GOAL_FIRST_RATIO, GOAL_SE = 0.8, 1.0, 2.0
# miles-lite's variants: synchronous rollouts (TRL's schedule: each step generates on the weights it trains) and
# one-step-off (the next step generates while this one trains, on weights one push older; importance-corrected).
ASYNC_STEPS = {"miles": 0, "miles-async": 1}
NAMES = {"trl": "TRL", "miles": "miles-lite", "miles-async": "miles-lite one-step-off"}


def reversed_letters(completions, label, **kwargs):
    """TRL's convention: 1.0 for the exact reversal, else half the share of letters in place (both sides)."""
    scores = []
    for completion, wanted in zip(completions, label, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        got, want = text.split(), wanted.split()
        same = sum(a == b for a, b in zip(got, want, strict=False))
        scores.append(1.0 if got == want else 0.5 * same / max(len(want), len(got), 1))
    return scores


# ---- children: one TRL run, one evaluation ----------------------------------------------------------------


def trl_child(args: argparse.Namespace) -> None:
    """One TRL GRPOTrainer run, printing `step k/N` as each step ends and `tokens k T` (completion tokens)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)

    class Steps(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            print(f"step {state.global_step}/{args.steps}", flush=True)

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                print(f"tokens {state.global_step} {logs['completions/mean_length'] * PROMPTS_PER_STEP * GROUP:.0f}",
                      flush=True)

    config = GRPOConfig(
        output_dir=str(args.out), per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP,
        max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, learning_rate=LR,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": MIN_LR}, warmup_steps=WARMUP,
        max_steps=args.steps, adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.0, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", num_iterations=1,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=args.seed,
        data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(model=str(args.model), reward_funcs=reversed_letters, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_json(str(args.data)), callbacks=[Steps()])
    trainer.train()
    trainer.save_model(str(args.out / "final"))
    tokenizer.save_pretrained(str(args.out / "final"))


def eval_child(args: argparse.Namespace) -> None:
    """Greedy decoding of every held-out prompt with transformers; prints `{"correct": c, "n": n}`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    right = sum(score == 1.0 for score in reversed_letters(completions, [r["label"] for r in rows]))
    print(json.dumps({"correct": right, "n": len(rows)}))


# ---- the parent: setup, interleaved runs, tables ----------------------------------------------------------


def load_average() -> float:
    return os.getloadavg()[0]


def env_for(threads: int) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "examples"),
                            os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_checked(cmd: list[str], env: dict[str, str], what: str) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def prepare(work: Path, base: Path | None, threads: int) -> tuple[Path, Path, Path]:
    """The conversational data files and the base model directory."""
    data = {}
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (LETTERS / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        path = data[split] = work / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}],
                                            "label": r["label"]}) + "\n" for r in rows))
    if base is None:
        base = work / "base"
        env = env_for(threads)
        run_checked([sys.executable, "-m", "miles_lite.cli", "train", "experiment=letters_cpu", "experiment.steps=0",
                     "experiment.eval_size=0", "rollout.engines=1", f"experiment.output_dir={work}",
                     "experiment.run_name=sft", "observability.progress=false"], env, "the SFT warm-up")
        run_checked([sys.executable, "-m", "miles_lite.cli", "convert", "--to-hf", str(work / "sft" / "checkpoints"),
                     str(base)], env, "the conversion of the SFT weights")
    return data["train"], data["eval"], base


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of process `root` and every live descendant (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == pid]
    return total


def stamped_run(cmd: list[str], env: dict[str, str], steps: int) -> dict:
    """Run `cmd`, stamping its `step k/N` and `tokens k T` lines; its timings, and the CPU seconds its processes
    spent per step between the end of step 1 and the end of the last (a figure the machine's load moves little)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ends: dict[int, float] = {}
    cpu: dict[int, float] = {}
    tokens: dict[int, float] = {}
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic() - start
        tail = (tail + [line])[-60:]
        if line.startswith("step ") and "/" in line:
            k = int(line.split()[1].split("/")[0])
            ends[k] = now
            if k in (1, steps):
                cpu[k] = tree_cpu_s(proc.pid)
        elif line.startswith("tokens "):
            _, k, n = line.split()
            tokens[int(k)] = float(n)
    code = proc.wait()
    wall = time.monotonic() - start
    if code != 0 or len(ends) != steps:
        raise SystemExit(f"run failed (exit {code}, {len(ends)}/{steps} steps): {' '.join(cmd)}\n{''.join(tail)}")
    times = [ends[k] - ends[k - 1] for k in range(2, steps + 1)]
    return {"first_step_s": ends[1], "step_s": statistics.median(times), "step_s_all": times, "wall_s": wall,
            "tokens": tokens, "cpu_per_step_s": (cpu[steps] - cpu[1]) / max(steps - 1, 1)}


def miles_cmd(model: Path, train: Path, steps: int, seed: int, out: Path, async_steps: int = 0) -> list[str]:
    return [sys.executable, "-m", "miles_lite.cli", "train", f"model.hf_path={model}", "data.source=records",
            f"data.train_path={train}", "data.prompt_key=prompt", "data.presample.enabled=false",
            f"data.shuffle_seed={seed}", "rewards.set=none", "rewards.custom=peer_trl:reversed_letters",
            "experiment.warmup=none", "experiment.eval_size=0", f"experiment.steps={steps}", f"experiment.seed={seed}",
            f"experiment.output_dir={out}", "experiment.run_name=run", "observability.progress=false",
            "rollout.engines=1", f"rollout.async_steps={async_steps}", f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
            f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={MAX_NEW}", "rollout.temperature=1.0",
            f"trainer.lr={LR}", f"trainer.min_lr={MIN_LR}", f"trainer.lr_warmup_steps={WARMUP}",
            "trainer.lr_schedule=cosine", "trainer.adam_beta2=0.98", "trainer.clip_grad=1.0", "algo=grpo",
            "algo.drop_zero_signal=false"]


def miles_tokens(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]) + 1: float(r["rollout/generated_tokens"]) for r in rows
            if "rollout/generated_tokens" in r and "eval_phase" not in r}


def held_out(model: Path, data: Path, threads: int) -> dict:
    out = run_checked([sys.executable, __file__, "--child", "eval", "--model", str(model), "--data", str(data),
                       "--threads", str(threads)], env_for(threads), f"the evaluation of {model}")
    return json.loads(out.strip().splitlines()[-1])


def one_run(side: str, args: argparse.Namespace, seed: int, work: Path, train: Path, held: Path,
            base: Path) -> dict:
    out = work / f"{side}-seed{seed}"
    env = env_for(args.threads)
    if side == "trl":
        cmd = [sys.executable, __file__, "--child", "trl", "--model", str(base), "--data", str(train), "--steps",
               str(args.steps), "--seed", str(seed), "--out", str(out), "--threads", str(args.threads)]
        result = stamped_run(cmd, env, args.steps)
        final = out / "final"
    else:
        cmd = miles_cmd(base, train, args.steps, seed, out, ASYNC_STEPS[side]) + list(args.overrides)
        result = stamped_run(cmd, env, args.steps)
        result["tokens"] = miles_tokens(out / "run")
        final = out / "final_hf"
        run_checked([sys.executable, "-m", "miles_lite.cli", "convert", "--to-hf", str(out / "run" / "checkpoints"),
                     str(final)], env, "the conversion of miles-lite's final weights")
    counted = [result["tokens"].get(k, 0.0) for k in range(2, args.steps + 1)]
    result["tokens_per_s"] = sum(counted) / sum(result["step_s_all"])
    result["accuracy"] = held_out(final, held, args.threads)
    result.update(side=side, seed=seed)
    del result["tokens"]
    return result


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.3f} ({min(values):.3f}-{max(values):.3f})"


def _accuracy(by: dict, side: str, seeds: list[int]) -> tuple[float, int]:
    right = sum(by[(side, s)]["accuracy"]["correct"] for s in seeds)
    n = sum(by[(side, s)]["accuracy"]["n"] for s in seeds)
    return right / n, n


def table(report: dict) -> str:
    runs = report["runs"]
    by = {(r["side"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    sides = [side for side in NAMES if any(r["side"] == side for r in runs)]
    lines = [f"{'seed':>4}  {'side':<12} {'first step s':>12} {'step s':>8} {'CPU s/step':>10} {'tok/s':>8} "
             f"{'wall s':>7} {'held-out':>9}"]
    for seed in seeds:
        for side in sides:
            r = by[(side, seed)]
            acc = r["accuracy"]["correct"] / r["accuracy"]["n"]
            lines.append(f"{seed:>4}  {side:<12} {r['first_step_s']:12.2f} {r['step_s']:8.3f} "
                         f"{r['cpu_per_step_s']:10.3f} {r['tokens_per_s']:8.0f} {r['wall_s']:7.1f} {100 * acc:8.1f}%")
    pt, nt = _accuracy(by, "trl", seeds)
    for side in sides[1:]:
        lines += ["", f"{'median (min-max)':<24} {'TRL':>24} {NAMES[side]:>24} {'ratio to TRL':>24}"]
        for key, name in (("step_s", "step time s"), ("cpu_per_step_s", "CPU s per step"),
                          ("first_step_s", "launch to first step s"), ("tokens_per_s", "tokens/s"),
                          ("wall_s", "launch to exit s")):
            trl = [by[("trl", s)][key] for s in seeds]
            ours = [by[(side, s)][key] for s in seeds]
            ratios = [m / t for m, t in zip(ours, trl, strict=True)]
            lines.append(f"{name:<24} {spread(trl):>24} {spread(ours):>24} {spread(ratios):>24}")
        pm, nm = _accuracy(by, side, seeds)
        se = math.sqrt(pt * (1 - pt) / nt + pm * (1 - pm) / nm) or 1e-9
        diff_se = (pm - pt) / se
        gap = f"{100 * (pm - pt):+.1f} points"
        lines.append(f"{'held-out accuracy':<24} {100 * pt:23.1f}% {100 * pm:23.1f}% {gap:>24}")
        step_ratio = statistics.median([by[(side, s)]["step_s"] / by[("trl", s)]["step_s"] for s in seeds])
        first_ratio = statistics.median([by[(side, s)]["first_step_s"] / by[("trl", s)]["first_step_s"]
                                         for s in seeds])
        lines.append(f"goals of {NAMES[side]}: step time {step_ratio:.2f}x TRL (<= {GOAL_STEP_RATIO}: "
                     f"{'met' if step_ratio <= GOAL_STEP_RATIO else 'NOT met'}), time to first step {first_ratio:.2f}x "
                     f"(<= {GOAL_FIRST_RATIO:g}: {'met' if first_ratio <= GOAL_FIRST_RATIO else 'NOT met'}), "
                     f"held-out accuracy {diff_se:+.2f} SE (within {GOAL_SE:g}: "
                     f"{'met' if abs(diff_se) <= GOAL_SE else 'NOT met'}; {len(seeds)} runs a side pooled)")
    cond = report["conditions"]
    lines.append("")
    lines.append(f"conditions: {cond['cpus']} CPUs, OMP_NUM_THREADS={cond['threads']}, {cond['steps']} steps a run, "
                 f"load average {cond['load_before']:.2f} before, {cond['load_after']:.2f} after; "
                 f"{cond['versions']}")
    return "\n".join(lines)


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "trl", "megatron-core"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (TRL's threads)")
    parser.add_argument("--variants", nargs="+", choices=tuple(ASYNC_STEPS), default=list(ASYNC_STEPS),
                        help="miles-lite's runs: synchronous rollouts (miles), one-step-off (miles-async)")
    parser.add_argument("--base", type=Path, default=None, help="start both from this HF directory")
    parser.add_argument("--work", type=Path, default=None, help="keep runs here (default: a temporary directory)")
    parser.add_argument("--table", type=Path, default=None, help="print the tables of a saved peer_trl.json")
    parser.add_argument("--child", choices=("trl", "eval"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra miles-lite overrides (after --)")
    args = parser.parse_args()
    if args.child == "trl":
        return trl_child(args)
    if args.child == "eval":
        return eval_child(args)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return None
    work = args.work or Path(tempfile.mkdtemp(prefix="peer_trl."))
    work.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    train, held, base = prepare(work, args.base, args.threads)
    runs = []
    sides = ["trl", *args.variants]
    for seed in range(args.pairs):
        shift = seed % len(sides)  # each run kind goes first, in the middle and last as often as the others
        for side in sides[shift:] + sides[:shift]:
            run = one_run(side, args, seed, work, train, held, base)
            acc = run["accuracy"]
            print(f"seed {seed} {side:<11}: first step {run['first_step_s']:6.2f} s, step {run['step_s']:.3f} s, "
                  f"{run['tokens_per_s']:.0f} tok/s, wall {run['wall_s']:.1f} s, held-out {acc['correct']}/{acc['n']}",
                  flush=True)
            runs.append(run)
    report = {"runs": runs, "conditions": {"cpus": os.cpu_count(), "threads": args.threads, "steps": args.steps,
                                           "load_before": load_before, "load_after": load_average(),
                                           "versions": versions(), "overrides": list(args.overrides)}}
    (work / "peer_trl.json").write_text(json.dumps(report, indent=1))
    print()
    print(table(report))
    print(f"\nruns and {work / 'peer_trl.json'} kept in {work}")


if __name__ == "__main__":
    main()
