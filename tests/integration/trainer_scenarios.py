"""Trainer scenarios executed inside spawned ranks (see trainer_harness.run_ranks); each returns plain data."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import torch

from miles_lite.config.schema import MilesConfig
from miles_lite.config.views import ActorConfig
from miles_lite.trainer.reference_layout import packed_row_layout
from miles_lite.types import TrainBatch


def make_config(hf_path: str | None, tp: int = 1, dp: int = 1, **trainer_kw: Any) -> MilesConfig:
    cfg = MilesConfig()
    cfg.model.hf_path = hf_path
    cfg.trainer.tp, cfg.trainer.dp = tp, dp
    cfg.trainer.device, cfg.trainer.layer_spec, cfg.trainer.precision = "cpu", "local", "fp32"
    cfg.trainer.micro_batch_tokens = 40
    cfg.trainer.logprob_chunk_tokens = 7
    cfg.trainer.lr = 1e-2
    cfg.trainer.clip_grad = 1.0
    cfg.algo.is_level = "token"
    cfg.algo.is_mode = "truncate"
    for key, value in trainer_kw.items():
        setattr(cfg.trainer, key, value)
    return cfg


def make_batch(vocab: int, n: int = 6, seed: int = 0, advantages: list[float] | None = None) -> TrainBatch:
    """Ragged sequences (lengths 6..21, prompts 2..5) with rollout logprobs set to a fixed offset."""
    rng = random.Random(seed)
    tokens, plens = [], []
    for _ in range(n):
        length = rng.randint(6, 21)
        tokens.append([rng.randrange(vocab) for _ in range(length)])
        plens.append(rng.randint(2, 5))
    lps = [[-3.0] * (len(t) - p) for t, p in zip(tokens, plens, strict=True)]
    adv = advantages if advantages is not None else [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return TrainBatch(tokens=tokens, prompt_lengths=plens, rollout_logprobs=lps, advantages=adv)


def make_mixed_batch(vocab: int) -> TrainBatch:
    """Sequences of very different lengths (3 to 60 tokens), for the padded layout."""
    rng = random.Random(7)
    lengths, plens = [60, 3, 17, 41, 4], [5, 1, 2, 30, 3]
    tokens = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    lps = [[-3.0] * (n - p) for n, p in zip(lengths, plens, strict=True)]
    return TrainBatch(tokens=tokens, prompt_lengths=plens, rollout_logprobs=lps, advantages=[1.0, -1.0, 1.0, -1.0, 1.0])


def hf_logprobs(path: str, batch: TrainBatch, vocab: int | None = None) -> list[list[float]]:
    """Reference: transformers forward, log_softmax over the first `vocab` columns, gather responses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for seq, plen in zip(batch.tokens, batch.prompt_lengths, strict=True):
            logits = model(torch.tensor([seq])).logits[0]
            if vocab is not None:
                logits = logits[:, :vocab]
            lp = logits.log_softmax(-1)[plen - 1:-1].gather(-1, torch.tensor(seq[plen:])[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def hf_logits(path: str, seq: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0]


def megatron_logits(actor: Any, seq: list[int]) -> torch.Tensor:
    """Full (TP-gathered, unpadded) logits of one sequence from the actor's Megatron model."""
    import torch.distributed as dist

    from miles_lite.trainer import cpu_compat
    from miles_lite.trainer.forward import _hidden_states
    from miles_lite.trainer.packing import pack

    handle = actor.policy
    mb = pack([seq], [1], [0])
    with torch.no_grad(), cpu_compat.device_mode():
        handle.model.eval()
        hidden = _hidden_states(handle, mb)
        weight = handle.model.shared_embedding_or_output_weight() if handle.model.share_embeddings_and_output_weights \
            else None
        local = handle.model.output_layer(hidden.unsqueeze(1), weight=weight)[0][:, 0, :]
    if handle.tp_group is not None:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(handle.tp_group))]
        dist.all_gather(parts, local.contiguous(), group=handle.tp_group)
        local = torch.cat(parts, dim=-1)
    return local[:, : handle.spec.vocab_size]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(max(abs(x - y) for x, y in zip(r1, r2, strict=True)) for r1, r2 in zip(a, b, strict=True))


def conversion_checks(actor: Any, path: str, batch: TrainBatch) -> dict[str, Any]:
    """Logits / logprobs against transformers, chunked-vs-unchunked, packed-vs-unpacked, HF round trip."""
    from miles_lite.trainer.hf_convert import read_hf_state

    res: dict[str, Any] = {}
    seq = batch.tokens[0]
    res["logits_max_diff"] = float((megatron_logits(actor, seq) - hf_logits(path, seq)).abs().max())
    packed = actor.compute_logprobs(batch)
    res["logprobs_vs_hf"] = _max_diff(packed, hf_logprobs(path, batch))
    trainer = actor.cfg.trainer
    saved = (trainer.micro_batch_tokens, trainer.logprob_chunk_tokens)
    trainer.micro_batch_tokens, trainer.logprob_chunk_tokens = 1, 10**6  # one sequence per row, one chunk
    unpacked = actor.compute_logprobs(batch)
    trainer.micro_batch_tokens, trainer.logprob_chunk_tokens = saved
    res["packed_vs_unpacked"] = _max_diff(packed, unpacked)
    # Local spec: sequences of 3 to 60 tokens in one padded micro-batch, then each in a micro-batch of its own.
    mixed = make_mixed_batch(actor.policy.spec.vocab_size)
    hf_mixed = hf_logprobs(path, mixed)
    for name, budget in (("mixed_together_vs_hf", 10**4), ("mixed_alone_vs_hf", 1)):
        trainer.micro_batch_tokens = budget
        res[name] = _max_diff(actor.compute_logprobs(mixed), hf_mixed)
        res[name.replace("vs_hf", "micro_batches")] = len(actor._micro_batches(mixed))
    trainer.micro_batch_tokens = saved[0]
    res["response_lengths_ok"] = [len(x) for x in packed] == batch.response_lengths
    exported = actor.export_hf_state_dict()
    if actor.par.rank == 0:
        original = read_hf_state(path)
        if actor.policy.spec.tie_word_embeddings:
            original.pop("lm_head.weight", None)
        res["roundtrip_keys_equal"] = set(exported) == set(original)
        res["roundtrip_bit_exact"] = all(torch.equal(exported[k], original[k]) for k in original if k in exported)
    return res


def _step_with_grads(actor: Any, step: Any) -> tuple[dict[str, float], torch.Tensor]:
    stats = step()
    return stats, torch.cat([buf.grad_data.detach().clone() for buf in actor.ddp.buffers])


def layout_checks(actor: Any, batch: TrainBatch) -> dict[str, Any]:
    """Padded batches against the packed row: log-probs, and the SFT and RL steps' losses and gradients
    from the same weights (the checkpoint state is restored before each step)."""
    out: dict[str, Any] = {}
    snap = copy.deepcopy(actor.state_dict_for_checkpoint())
    steps = {"logprobs": lambda: (actor.compute_logprobs(batch), None),
             "sft": lambda: _step_with_grads(actor, lambda: actor.sft_step(batch, lr=1e-3)),
             "rl": lambda: _step_with_grads(actor, lambda: actor.train_step(batch))}
    for name, run in steps.items():
        actor.load_checkpoint_state(snap)
        padded = run()
        actor.load_checkpoint_state(snap)
        with packed_row_layout():
            packed = run()
        out[name] = (padded, packed)
    out["micro_batches"] = len(actor._micro_batches(batch))
    with packed_row_layout():
        out["packed_micro_batches"] = len(actor._micro_batches(batch))
    actor.load_checkpoint_state(snap)
    return out


def train_checks(actor: Any, batch: TrainBatch) -> dict[str, Any]:
    before = actor.compute_logprobs(batch)
    on_policy = TrainBatch(batch.tokens, batch.prompt_lengths, before, batch.advantages)
    stats = actor.train_step(on_policy)
    after = actor.compute_logprobs(batch)
    return {"before": before, "after": after, "stats": stats}


def make_checkpoints(rank: int, root: str) -> tuple[dict[str, str], str]:
    """Rank 0 writes one test checkpoint per arch plus a teacher with 140 extra vocabulary rows."""
    import torch.distributed as dist
    from trainer_harness import make_test_checkpoint

    ckpts = {arch: str(Path(root) / arch) for arch in ("qwen2", "llama", "qwen3")}
    teacher = str(Path(root) / "teacher")
    if rank == 0:
        for arch, path in ckpts.items():
            make_test_checkpoint(arch, Path(path))
        make_test_checkpoint("qwen2", Path(teacher), vocab_size=640, seed=5)
    dist.barrier()
    return ckpts, teacher


def checks_with_te_installed(path: str, rank: int, world_size: int, batch: TrainBatch) -> dict[str, Any]:
    """A CPU trainer where TransformerEngine imports (the GPU image): megatron-core then defaults the
    block's final norm to TENorm and the optimizer to TE's FusedAdam and multi-tensor kernels, all CUDA
    only. Stand-ins that refuse to run take their places; the step must equal one built without them."""
    import importlib

    import megatron.core.transformer.transformer_block as block

    from miles_lite.trainer.actor import TrainerActor

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a CUDA-only TransformerEngine piece ran on the CPU trainer")

    class Refused(torch.nn.Module):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()

    plain = TrainerActor(ActorConfig.of(make_config(path)), rank, world_size)
    expected = train_checks(plain, batch)
    plain.close()

    package = importlib.import_module("megatron.core.optimizer")
    clip, opt = (importlib.import_module(f"megatron.core.optimizer.{m}") for m in ("clip_grads", "optimizer"))
    stand_ins = [(block, "LayerNormImpl", Refused), (package, "Adam", Refused), (package, "SGD", Refused),
                 (package, "USING_PYTORCH_OPTIMIZER", False)]
    stand_ins += [(m, a, refuse) for m in (clip, opt) for a in ("multi_tensor_applier", "multi_tensor_scale_impl",
                                                                 "l2_norm_impl") if hasattr(m, a)]
    saved = [(m, a, getattr(m, a)) for m, a, _ in stand_ins]
    for module, attr, value in stand_ins:
        setattr(module, attr, value)
    try:
        actor = TrainerActor(ActorConfig.of(make_config(path)), rank, world_size)
        norm = type(actor.policy.model.decoder.final_layernorm).__name__
        logprobs_vs_hf = _max_diff(actor.compute_logprobs(batch), hf_logprobs(path, batch))
        got = train_checks(actor, batch)
        actor.close()
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
    return {"final_norm": norm, "logprobs_vs_hf": logprobs_vs_hf,
            "grad_norm": (got["stats"]["grad_norm"], expected["stats"]["grad_norm"]),
            "after_step_diff": _max_diff(got["after"], expected["after"]),
            "step_moved": _max_diff(got["after"], got["before"])}


def scenario_single(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """TP=1, one process: conversion for every arch; train step, NaN guard, reference, teacher, checkpoint."""
    from miles_lite.trainer.actor import NonFiniteStepError, TrainerActor
    from miles_lite.trainer.optim import current_lr

    ckpts, teacher = make_checkpoints(rank, root)
    out: dict[str, Any] = {}
    batch = make_batch(500)
    for arch, path in ckpts.items():
        actor = TrainerActor(ActorConfig.of(make_config(path)), rank, world_size)
        out[arch] = conversion_checks(actor, path, batch)
        actor.close()

    out["te_installed"] = checks_with_te_installed(ckpts["qwen2"], rank, world_size, batch)
    actor = TrainerActor(ActorConfig.of(make_config(ckpts["qwen2"])), rank, world_size)
    out["layouts"] = layout_checks(actor, batch)
    out["layouts_mixed"] = layout_checks(actor, make_mixed_batch(500))
    actor.close()

    cfg = make_config(ckpts["qwen2"], keep_reference=True, max_nonfinite_skips=2)
    cfg.experiment.teacher_path = teacher
    actor = TrainerActor(ActorConfig.of(cfg), rank, world_size)
    out["train"] = train_checks(actor, batch)
    out["reference"] = actor.compute_logprobs(batch, "reference")
    out["teacher"] = actor.compute_logprobs(batch, "teacher")
    out["teacher_hf_trimmed"] = hf_logprobs(teacher, batch, vocab=500)
    out["teacher_hf_untrimmed"] = hf_logprobs(teacher, batch)

    # Checkpoint: snapshot, step, restore, step again -> identical weights.
    snap = copy.deepcopy(actor.state_dict_for_checkpoint())
    actor.train_step(batch)
    first = {n: t.clone() for n, t, _ in actor.named_shards()}
    actor.load_checkpoint_state(snap)
    actor.train_step(batch)
    out["ckpt_max_diff"] = max(float((t - first[n]).abs().max()) for n, t, _ in actor.named_shards())

    # NaN guard: a NaN advantage skips the step without touching weights; the limit raises.
    nan_batch = TrainBatch(batch.tokens, batch.prompt_lengths, batch.rollout_logprobs,
                           [float("nan")] + batch.advantages[1:])
    weights = {n: t.clone() for n, t, _ in actor.named_shards()}
    nan_stats = actor.train_step(nan_batch)
    out["nan_stats"] = nan_stats
    out["nan_weights_unchanged"] = all(torch.equal(t, weights[n]) for n, t, _ in actor.named_shards())
    try:
        actor.train_step(nan_batch)
        out["nan_limit_error"] = None
    except NonFiniteStepError as err:
        out["nan_limit_error"] = str(err)
    out["nan_weights_finite"] = all(bool(torch.isfinite(t).all()) for _, t, _ in actor.named_shards())
    # The distillation weight of one batch (algo.distill_coef is 0 here): the RL phase's schedule.
    out["distill_on"] = actor.train_step(batch, distill_coef=0.5)
    out["distill_off"] = actor.train_step(batch)
    actor.close()

    # PPO updates: 3 mini-batches x 2 epochs on one rollout batch, all against the log-probs from before.
    cfg = make_config(ckpts["qwen2"], lr_schedule="linear", lr_decay_steps=10)
    cfg.algo.updates_per_rollout, cfg.algo.epochs_per_rollout = 3, 2
    actor = TrainerActor(ActorConfig.of(cfg), rank, world_size)
    lr0 = current_lr(actor.optimizer)
    out["ppo"] = train_checks(actor, batch)
    out["ppo"]["lr_before"], out["ppo"]["lr_after"] = lr0, current_lr(actor.optimizer)
    out["ppo"]["optimizer_steps"] = actor.steps_done
    actor.close()
    return out


def scenario_two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Two ranks: TP=2 conversion for every arch and a TP=2 train step; then a DP=2 train step."""
    from miles_lite.trainer.actor import TrainerActor

    ckpts, _ = make_checkpoints(rank, root)
    out: dict[str, Any] = {}
    batch = make_batch(500)
    for arch, path in ckpts.items():
        actor = TrainerActor(ActorConfig.of(make_config(path, tp=2)), rank, world_size)
        out[arch] = conversion_checks(actor, path, batch)
        out[arch]["layouts"] = {n: (lay.kind.value, lay.hf_names, lay.local_shape, lay.full_shape)
                                for n, _, lay in actor.named_shards()}
        if arch == "qwen2":
            out["train_tp2"] = train_checks(actor, batch)
        actor.close()
    actor = TrainerActor(ActorConfig.of(make_config(ckpts["qwen2"], dp=2)), rank, world_size)
    out["train_dp2"] = train_checks(actor, batch)
    actor.close()
    return out
