"""`benchmarks/grpo_steps.py --profile-push`: the torch profiler over the hand-over of chosen steps, each push phase
and the trainer's probe scoring labelled (the module docstring of `grpo_steps.py` says what it writes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any


class PushProfiler:
    """`--profile-push`: the torch profiler over the hand-over of the chosen steps (see the module docstring). It
    wraps the hand-off's and the coordinator's methods for this process, each phase of `PhaseTimer` labelled while a
    profile runs."""

    def __init__(self, steps: set[int], out_dir: Path) -> None:
        self.steps, self.out_dir = steps, out_dir
        self._prof: Any = None
        self._step: int | None = None

    def install(self) -> None:
        import torch.profiler as tp

        from miles_lite import timing
        from miles_lite.run.handoff import Handoff
        from miles_lite.weight_sync.coordinator import WeightSyncCoordinator

        profiler = self
        prepare, push, score, phase = (Handoff.prepare_push, Handoff.push, WeightSyncCoordinator.score_trainer_probe,
                                       timing.PhaseTimer.phase)

        def prepare_push(handoff: Any, version: int, *args: Any, **kwargs: Any) -> None:
            if version in profiler.steps and profiler._prof is None:
                profiler.start(version)
            with tp.record_function("prepare_push"):
                prepare(handoff, version, *args, **kwargs)

        def push_profiled(handoff: Any, version: int) -> Any:
            try:
                with tp.record_function("push"):
                    return push(handoff, version)
            finally:
                if profiler._step == version:
                    profiler.stop()

        def score_labelled(coordinator: Any, version: str) -> float:
            with tp.record_function("probe_trainer"):
                return score(coordinator, version)

        @contextmanager
        def phase_labelled(timer: Any, name: str) -> Iterator[None]:
            with phase(timer, name), (tp.record_function(f"phase {name}") if profiler._prof is not None
                                      else nullcontext()):
                yield

        Handoff.prepare_push, Handoff.push = prepare_push, push_profiled  # type: ignore[method-assign]
        WeightSyncCoordinator.score_trainer_probe = score_labelled  # type: ignore[method-assign]
        timing.PhaseTimer.phase = phase_labelled  # type: ignore[method-assign]

    def start(self, step: int) -> None:
        import torch
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof, self._step = tp.profile(activities=activities), step
        self._prof.__enter__()

    def stop(self) -> None:
        prof, step = self._prof, self._step
        self._prof = self._step = None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        averages = prof.key_averages()
        tables = [averages.table(sort_by="self_cpu_time_total", row_limit=40)]
        if any(e.device_time_total for e in averages):
            tables.append(averages.table(sort_by="self_device_time_total", row_limit=25))
        (self.out_dir / f"step-{step}.txt").write_text("\n\n".join(tables))
        prof.export_chrome_trace(str(self.out_dir / f"step-{step}.json.gz"))
        print(f"push profile of step {step}: {self.out_dir}/step-{step}.txt", flush=True)
