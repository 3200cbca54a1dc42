"""Timing of benchmark steps: device-synchronised wall times, interleaved A/B rounds, summaries, profiles.

Used by the trainer benchmarks (`train_step.py`, `cpu_micro_batches.py`); benchmarks run as scripts,
so they import this module from their own directory.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

H200_BF16_PEAK_TFLOPS = 989.0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarize(times: list[float], tokens: int, flops: float) -> dict[str, Any]:
    """Median step time -> tokens/s, model TFLOP/s and MFU (fraction of the H200 bf16 peak); min/max step time."""
    med = statistics.median(times)
    tflops = flops / med / 1e12
    return {"step_s": med, "step_s_min": min(times), "step_s_max": max(times), "steps": len(times),
            "tokens_per_s": tokens / med, "tflops": tflops, "mfu": tflops / H200_BF16_PEAK_TFLOPS}


def time_interleaved(fns: dict[str, Any], warmup: int, steps: int) -> dict[str, list[float]]:
    """Seconds of `steps` timed calls of each of `fns`, alternating A, B, A, B... after `warmup` rounds, so
    that slow drifts of the GPU (clocks, memory fragmentation) affect every variant alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - t0)
    return times


def profile_steps(fns: dict[str, Any], out_dir: Path, steps: int = 2) -> dict[str, str]:
    """A torch profiler trace of `steps` calls of each of `fns` (after the timed runs), and the table of the
    30 costliest operators by device time; returns {name: table}. Traces go to `out_dir/<name>.json.gz`, the
    tables to `out_dir/<name>.txt`, and the 30 costliest by host time to `out_dir/<name>.host.txt` (a step bound
    by the host shows there what it spends its time on)."""
    from torch.profiler import ProfilerActivity, profile

    out_dir.mkdir(parents=True, exist_ok=True)
    tables = {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for name, fn in fns.items():
        _sync()
        with profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
            _sync()
        prof.export_chrome_trace(str(out_dir / f"{name}.json.gz"))
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        tables[name] = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
        (out_dir / f"{name}.txt").write_text(tables[name])
        (out_dir / f"{name}.host.txt").write_text(prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    return tables


def time_steps(fn: Any, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` timed calls of `fn()` after `warmup` untimed ones."""
    return time_interleaved({"step": fn}, warmup, steps)["step"]
