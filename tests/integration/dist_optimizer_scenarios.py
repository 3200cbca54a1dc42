"""Distributed-optimizer checkpoint scenarios, one spawned job per data-parallel size (`test_dist_optimizer.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from trainer_harness import make_test_checkpoint
from trainer_scenarios import make_batch, make_config

from miles_lite.checkpoint import DriverState, newest_complete
from miles_lite.checkpoint.run_state import RankCheckpointer
from miles_lite.config.views import ActorConfig

VOCAB = 500
STEPS = 3


def _batch(step: int):
    # Two sequences of at most 21 tokens, each its own micro-batch (trainer.micro_batch_tokens=40): at DP 2 each
    # rank takes one, at DP 1 both run in turn, and the gradients add up in the same order either way.
    return make_batch(VOCAB, n=2, seed=100 + step)


def _actor(model_dir: str, ckpt_dir: str, rank: int, world_size: int) -> Any:
    from miles_lite.trainer.actor import TrainerActor

    # clip_grad=0: the gradient norm's reduction order depends on the DP size, its clipping factor too.
    cfg = make_config(model_dir, dp=world_size, precision="bf16", use_distributed_optimizer=True, clip_grad=0.0)
    cfg.checkpoint.dir = ckpt_dir
    return cfg, TrainerActor(ActorConfig.of(cfg), rank, world_size)


def _state(actor: Any) -> dict[str, Any]:
    """The trainer's whole state, gathered per parameter: weights, fp32 main values, Adam moments (DP rank 0)."""
    sd = actor.state_dict_for_checkpoint()
    out: dict[str, Any] = {"weights": {n: t.detach().clone() for n, t in sd["model"].items()}, "optim": None}
    params = sd["optimizer"].params
    if params is not None:
        out["optim"] = {n: (ps.master.clone(), {k: v.clone() for k, v in ps.moments.items()},
                            None if ps.step is None else float(ps.step)) for n, ps in params.items()}
    out["steps_done"] = actor.steps_done
    return out


def scenario(rank: int, world_size: int, root: str, resume_from: str | None, save_to: str,
             train_steps: list[int], save_after: int | None) -> dict[str, Any]:
    """Resume (when `resume_from`), train steps `train_steps` (indices of the batches), checkpoint after
    `save_after` of them into `save_to`; returns the states after loading and at the end."""
    model_dir = str(Path(root) / "model")
    if rank == 0 and not Path(model_dir, "config.json").exists():
        make_test_checkpoint("qwen2", Path(model_dir), vocab_size=VOCAB)
    torch.distributed.barrier()
    cfg, actor = _actor(model_dir, save_to, rank, world_size)
    ckpt = RankCheckpointer(cfg.checkpoint, cfg.model)
    out: dict[str, Any] = {}
    if resume_from is not None:
        path = newest_complete(resume_from)
        assert path is not None
        RankCheckpointer.restore(actor, path)
    out["loaded"] = _state(actor)
    for k, step in enumerate(train_steps):
        if save_after == k:
            out["saved"] = _state(actor)
            ckpt.save(actor, step, DriverState(step=step, weight_version=step, data={}))
            ckpt.finalize()
        actor.train_step(_batch(step))
    if save_after == len(train_steps):
        out["saved"] = _state(actor)
        ckpt.save(actor, train_steps[-1] + 1 if train_steps else 0, DriverState(step=0, weight_version=0, data={}))
        ckpt.finalize()
    out["final"] = _state(actor)
    ckpt.close()
    actor.close()
    return out
