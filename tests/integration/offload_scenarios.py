"""Trainer offload scenarios, run in a spawned rank by `test_trainer_offload.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from trainer_harness import make_test_checkpoint
from trainer_scenarios import make_batch, make_config

from miles_lite.checkpoint.run_state import RankCheckpointer
from miles_lite.config.offload import OFFLOAD_PARTS
from miles_lite.config.views import ActorConfig

VOCAB = 500


def _state(actor: Any) -> dict[str, torch.Tensor]:
    """Copies of everything offload keeps: parameters and optimizer tensors (gradients are dropped: below)."""
    out = {f"param/{n}": p.detach().clone() for n, p in actor.policy.model.named_parameters()}
    out.update({f"opt/{i}": t.detach().clone() for i, t in enumerate(actor.offloader.collectors["optimizer"]())})
    return out


def _grads(actor: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in actor.offloader.collectors["grads"]() if t is not None]


def _steps(path: str, rank: int, world_size: int, precision: str, round_trip: bool,
           ckpt_dir: str) -> dict[str, Any]:
    from miles_lite.trainer.actor import TrainerActor

    cfg = make_config(path, precision=precision)
    cfg.checkpoint.dir = ckpt_dir
    actor = TrainerActor(ActorConfig.of(cfg), rank, world_size)
    batch = make_batch(VOCAB)
    if round_trip:
        actor.stage_offload(("params",))  # the step's optimizer update writes the parameters: these copies go
    out: dict[str, Any] = {"stats": [actor.train_step(batch)]}
    if round_trip:
        before = _state(actor)
        out["grads_nonzero_before"] = any(bool(g.count_nonzero()) for g in _grads(actor))
        # As a hand-off prepares its push: the gradients freed, the optimizer state and the parameters staged; a
        # checkpoint saved then writes those copies, and the offload takes them.
        out["dropped"] = actor.offload(("grads",))
        out["device_memory"] = actor.device_memory(parts=True)  # what trainer.offload.when=needed plans with
        out["staged"] = actor.stage_offload(("optimizer", "params"))
        ckpt = RankCheckpointer(cfg.checkpoint, cfg.model)
        ckpt.prepare(actor, staged=True)  # as a hand-off's trainer rank starts: no host buffers reserved
        saved = ckpt.save(actor, 1)
        out["saved"] = {"bytes": saved.bytes, "reused_bytes": saved.reused_bytes, **ckpt.saver.describe()}
        moved = actor.offload(OFFLOAD_PARTS)
        out["moved"] = moved
        out["freed"] = all(p.untyped_storage().nbytes() == 0 for p in actor.policy.model.parameters())
        grads = [t for t in actor.offloader.collectors["grads"]() if t is not None]
        out["grads_freed"] = all(t.untyped_storage().nbytes() == 0 for t in grads)
        out["resident_while_offloaded"] = actor.memory_stats()["trainer_state_bytes"]
        try:
            actor.compute_logprobs(batch)
            out["refused"] = None
        except RuntimeError as exc:
            out["refused"] = str(exc)
        out["again"] = actor.offload(OFFLOAD_PARTS)  # a no-op: everything is offloaded already
        out["onloaded"] = actor.onload(OFFLOAD_PARTS)
        after = _state(actor)
        out["grads_zero_after"] = all(not g.count_nonzero() for g in _grads(actor))
        out["round_trip_exact"] = before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before)
        out["tensors"] = len(before)
    out["stats"].append(actor.train_step(batch))
    out["params"] = {n: p.detach().clone() for n, p in actor.policy.model.named_parameters()}
    out["logprobs"] = actor.compute_logprobs(batch)
    actor.close()
    if round_trip:  # the checkpoint, flushed while the state moved on, holds the state it was saved at
        out["checkpoint_exact"] = _restores_exactly(ckpt, cfg, rank, world_size, before)
    return out


def _restores_exactly(ckpt: RankCheckpointer, cfg: Any, rank: int, world_size: int,
                      before: dict[str, torch.Tensor]) -> bool:
    """Whether the save in flight, once committed, loads into a fresh actor as the state `before`, bit for bit."""
    from miles_lite.trainer.actor import TrainerActor

    done = ckpt.finalize()
    ckpt.close()
    assert done is not None
    restored = TrainerActor(ActorConfig.of(cfg), rank, world_size)
    RankCheckpointer.restore(restored, done.path)
    again = _state(restored)
    restored.close()
    return again.keys() == before.keys() and all(torch.equal(before[k], again[k]) for k in before)


def _kept(path: str, rank: int, world_size: int, precision: str, ckpt_dir: str) -> dict[str, Any]:
    """As a hand-off keeping its state on the device (`trainer.offload.when=needed`) saves: the state staged while it
    stays, the save writing those copies, the copies dropped after the push, then the next step writing the state
    while the save still flushes."""
    from miles_lite.trainer.actor import TrainerActor

    cfg = make_config(path, precision=precision)
    cfg.checkpoint.dir = ckpt_dir
    actor = TrainerActor(ActorConfig.of(cfg), rank, world_size)
    batch = make_batch(VOCAB)
    actor.train_step(batch)
    actor.offload(("grads",))
    before = _state(actor)
    actor.stage_offload(("params", "optimizer"))
    ckpt = RankCheckpointer(cfg.checkpoint, cfg.model)
    ckpt.prepare(actor, staged=True)
    saved = ckpt.save(actor, 1)
    actor.drop_staged(("params", "optimizer"))
    name, first = next(iter(actor.policy.model.named_parameters()))
    out: dict[str, Any] = {"saved": {"bytes": saved.bytes, "reused_bytes": saved.reused_bytes},
                           "dropped": actor.offloader.staged_copies()(first) is None,
                           "resident": actor.offloader.offloaded() == {"grads"}}
    actor.onload(OFFLOAD_PARTS)
    actor.train_step(batch)
    out["moved_on"] = not torch.equal(first.detach(), before[f"param/{name}"])
    actor.close()
    out["checkpoint_exact"] = _restores_exactly(ckpt, cfg, rank, world_size, before)
    return out


def scenario_offload(rank: int, world_size: int, root: str) -> dict[str, Any]:
    path = str(make_test_checkpoint("qwen2", Path(root) / "qwen2", vocab_size=VOCAB))
    return {precision: {"offloaded": _steps(path, rank, world_size, precision, True, f"{root}/ckpt-{precision}"),
                        "resident": _steps(path, rank, world_size, precision, False, f"{root}/unused"),
                        "kept": _kept(path, rank, world_size, precision, f"{root}/kept-{precision}")}
            for precision in ("fp32", "bf16")}
