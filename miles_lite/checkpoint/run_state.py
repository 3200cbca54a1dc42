"""What the driver calls: save a run (trainer shards + driver state + HF assets) and resume one.

`RankCheckpointer` is the per-rank object (one per trainer rank, held for the whole run so that
one asynchronous save stays in flight between steps); `save_run` / `resume_run` apply it to the
driver's in-process trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_lite.checkpoint.async_ckpt import AsyncCheckpointer, SaveStats
from miles_lite.checkpoint.driver_state import DriverState, capture_driver_rng, restore_driver_rng
from miles_lite.checkpoint.host_buffers import HostBuffers
from miles_lite.checkpoint.resume import CheckpointReader, resolve_resume, set_aside_newer
from miles_lite.checkpoint.trainer_state import checkpoint_payload, hf_assets, restore_actor, snapshot_sizes
from miles_lite.config.schema import MilesConfig


def tokenizer_dir(cfg: MilesConfig) -> Path | None:
    """Where the run's tokenizer files are: `model.tokenizer_path`, else `model.hf_path`, else None."""
    for candidate in (cfg.model.tokenizer_path, cfg.model.hf_path):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


class RankCheckpointer:
    """Checkpoints of one trainer rank's `TrainerActor` (plus, on rank 0, the driver state and HF assets).

    Args:
        cfg: the run's config (`checkpoint.*`, `model.*` for the assets).
        timeout_s: how long a rank waits for the others while flushing.
    """

    def __init__(self, cfg: MilesConfig, timeout_s: float = 1800.0, buffers: HostBuffers | None = None) -> None:
        self.cfg = cfg
        self.saver = AsyncCheckpointer.from_config(cfg.checkpoint, timeout_s=timeout_s, buffers=buffers)

    def save(self, actor: Any, step: int, driver: DriverState | None = None) -> SaveStats:
        """Snapshot `actor` (and `driver` on rank 0) as checkpoint `step`; returns once training may go on."""
        rank0 = self.saver.rank == 0
        assets = hf_assets(actor.hf_config, tokenizer_dir(self.cfg)) if rank0 else None
        meta = {"weight_version": driver.weight_version} if rank0 and driver is not None else None
        payload = checkpoint_payload(actor, driver.to_tree() if rank0 and driver is not None else None,
                                     assets=assets, meta=meta)
        return self.saver.save(step, payload)

    def finalize(self) -> SaveStats | None:
        """Wait for the save in flight; its completed stats (None when nothing was saved)."""
        return self.saver.finalize()

    def close(self) -> None:
        self.saver.close()

    @staticmethod
    def restore(actor: Any, path: str | Path) -> DriverState | None:
        """Load checkpoint `path` into `actor` (verifying checksums); the driver state it holds, if any."""
        reader = CheckpointReader(path)
        try:
            shared = restore_actor(actor, reader)
        finally:
            reader.close()
        tree = shared.get("driver")
        return DriverState.from_tree(tree) if tree is not None else None


class ActorCheckpoints:
    """Checkpoints of one trainer rank's actor, as its role (in-process or a Ray actor) runs them.

    The `RankCheckpointer` is made on the first save and held for the run, so one save's flush
    overlaps the next steps.
    """

    def __init__(self) -> None:
        self.checkpointer: RankCheckpointer | None = None
        self.buffers: HostBuffers | None = None

    def prepare(self, actor: Any, cfg: MilesConfig) -> None:
        """At trainer start-up, when the run saves asynchronously every `checkpoint.interval` steps:
        start allocating the snapshots' host buffers on a background thread, so that the first save
        blocks training only for its copies (allocating ~7 GB of pinned memory takes seconds)."""
        if self.buffers is None and cfg.checkpoint.async_save and cfg.checkpoint.interval > 0:
            self.buffers = HostBuffers()
            self.buffers.reserve(snapshot_sizes(actor))

    def save(self, actor: Any, cfg: MilesConfig, step: int, driver: DriverState | None, final: bool) -> SaveStats:
        """Snapshot `actor` (and `driver` on rank 0) as checkpoint `step`; `final` waits for the commit."""
        if self.checkpointer is None:
            self.checkpointer = RankCheckpointer(cfg, buffers=self.buffers)
        stats = self.checkpointer.save(actor, step, driver)
        return (self.checkpointer.finalize() or stats) if final else stats

    def finalize(self) -> SaveStats | None:
        """Wait for the save in flight to commit; its stats (None when nothing was saved)."""
        return self.checkpointer.finalize() if self.checkpointer is not None else None

    @staticmethod
    def restore(actor: Any, path: str) -> DriverState | None:
        """Load checkpoint `path` into `actor` (any TP/DP it was saved with); its driver state, if any."""
        return RankCheckpointer.restore(actor, path)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        elif self.buffers is not None:
            self.buffers.clear()


def save_run(cfg: MilesConfig, system: Any, data: Any, steps_done: int, metrics: Any = None,
             final: bool = False) -> SaveStats | None:
    """Checkpoint the run after `steps_done` steps (no-op when `checkpoint.dir` is unset).

    Every trainer rank snapshots its own shards through its role's checkpointer (`system.trainer.
    save_checkpoint`: in-process or on each Ray actor) and returns to training while the flush runs;
    rank 0 adds the driver state (step, weight version, data cursor, RNG) and commits.

    Args:
        system: holds `trainer` (a trainer role) and `version` (weights pushed).
        data: the `PromptSource` (its cursor and epoch order are saved).
        metrics: receives `checkpoint_blocked(s)` / `checkpoint_committed(flush_s, bytes, step)` when given.
        final: wait for the flush before returning (end of run).
    """
    if not cfg.checkpoint.dir:
        return None
    if final and getattr(system, "last_checkpoint_step", None) == steps_done:
        # The periodic save already took this step: only wait for its commit.
        stats = system.trainer.finalize_checkpoint()
        if metrics is not None and stats is not None and stats.flush_s is not None:
            metrics.checkpoint_committed(stats.flush_s, int(stats.total_bytes or stats.bytes), stats.step)
        return stats
    driver = DriverState(step=steps_done, weight_version=int(getattr(system, "version", 0)),
                         data=data.state_dict(), rng=capture_driver_rng())
    stats = system.trainer.save_checkpoint(cfg, steps_done, driver, final)
    system.last_checkpoint_step = steps_done
    if metrics is not None:
        metrics.checkpoint_blocked(stats.blocked_s)
        if stats.flush_s is not None:
            metrics.checkpoint_committed(stats.flush_s, int(stats.total_bytes or stats.bytes), stats.step)
    return stats


def resume_run(cfg: MilesConfig, system: Any, data: Any, log: Callable[[str], None] = print) -> int:
    """Restore the checkpoint `checkpoint.resume` selects; returns the step to continue from (0: fresh).

    Restores the trainer (any TP/DP), the data cursor, the driver's RNG streams and weight version,
    then pushes the restored weights to the engines (they start from the initial model). Checkpoints
    in `checkpoint.dir` newer than the one resumed (a roll-back, or damaged ones passed over) are
    moved aside, so that the run's own later checkpoints are the ones auto-resume and retention see.
    """
    path = resolve_resume(cfg.checkpoint, log)
    if path is None:
        return 0
    driver = system.trainer.restore_checkpoint(str(path))
    step = driver.step if driver is not None else 0
    if cfg.checkpoint.dir:
        set_aside_newer(cfg.checkpoint.dir, step, log)
        if path.parent.resolve() == Path(cfg.checkpoint.dir).resolve():
            # This step's checkpoint exists where the run writes: a final save at this step is skipped.
            system.last_checkpoint_step = step
    if driver is None:
        log(f"checkpoint {path}: weights loaded (no driver state: an initial checkpoint); starting at step 0")
        return 0
    data.load_state_dict(driver.data)
    restore_driver_rng(driver.rng)
    system.version = driver.weight_version
    if getattr(system, "sync", None) is not None:
        system.push_weights()
    log(f"resumed from {path} at step {driver.step} (weight version {driver.weight_version})")
    return driver.step
