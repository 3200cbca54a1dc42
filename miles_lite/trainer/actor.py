"""`TrainerActor`: one Megatron trainer rank (TP x DP) — logprobs, RL/SFT steps; its weights out
(`actor_weights.py`) and its checkpoint state (`actor_checkpoint.py`) are mixins.

Lifecycle: INITIALIZING -> READY (all methods usable) -> CLOSED; a failure during set-up leaves
FAILED. Every rank of the trainer runs the same calls in the same order with the same batch; data
parallel ranks each take a token-balanced share of the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_lite.algo.device_stats import DeviceStats, read_many
from miles_lite.config.schema import AlgoConfig
from miles_lite.config.views import ActorConfig
from miles_lite.trainer import cpu_compat
from miles_lite.trainer.actor_checkpoint import ActorCheckpoint
from miles_lite.trainer.actor_offload import ActorOffload
from miles_lite.trainer.actor_weights import ActorWeights
from miles_lite.trainer.dist_optimizer import is_distributed
from miles_lite.trainer.expert_parallel import align_micro_batches, needs_alignment, scale_expert_grads
from miles_lite.trainer.forward import LogprobOptions, ModelHandle, response_logprobs
from miles_lite.trainer.fp8 import fp8_off
from miles_lite.trainer.guard import DivergedStepError, NonFiniteStepError, UpdateGuard, all_finite
from miles_lite.trainer.hf_convert import mark_tensor_parallel
from miles_lite.trainer.loading import build_handle, load_policy_source, load_teacher_source
from miles_lite.trainer.lora import attach_lora
from miles_lite.trainer.offload import actor_offload
from miles_lite.trainer.optim import build_optimizer, build_scheduler, current_lr, set_lr, wrap_ddp
from miles_lite.trainer.packing import PackedMicroBatch, pack, plan_micro_batches, split_for_data_parallel
from miles_lite.trainer.parallel import ParallelInfo, init_parallel, shutdown_parallel
from miles_lite.trainer.rl_loss import BatchTotals, reduce_stats, rl_micro_loss, sft_micro_loss
from miles_lite.trainer.routing import ModelRouting, RoutingStats, check_routed
from miles_lite.trainer.updates import combine_update_stats, minibatch_plan
from miles_lite.types import TrainBatch

MODELS = ("policy", "reference", "teacher")


class ActorState(StrEnum):
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


# A micro-batch's loss, its statistics (0-d tensors, read once a step) and its share of the batch's loss.
MicroLoss = Callable[[PackedMicroBatch], tuple[Tensor, DeviceStats, float]]


class TrainerActor(ActorCheckpoint, ActorOffload, ActorWeights):
    """One trainer rank: a Megatron `GPTModel` shard, its optimizer, and optional reference/teacher.

    Args:
        cfg: what a rank reads (`model`, `trainer`, `algo`, the distillation teacher, the schedule's length).
        rank / world_size: this process among the trainer's `trainer.tp * trainer.dp` ranks.
        init_method: torch.distributed rendezvous URL (None: env:// from MASTER_ADDR/MASTER_PORT).
        total_steps: optimizer steps the LR schedule spans (None: `cfg.steps`, from `experiment.steps`).
    """

    def __init__(self, cfg: ActorConfig, rank: int, world_size: int, *, init_method: str | None = None,
                 total_steps: int | None = None) -> None:
        self.state = ActorState.INITIALIZING
        self.cfg = cfg
        self.steps_done = 0
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.diverged_in_a_row = 0
        self.diverged_total = 0
        try:
            self._setup(rank, world_size, init_method, total_steps)
        except BaseException:
            self.state = ActorState.FAILED
            raise
        self.state = ActorState.READY

    def _setup(self, rank: int, world_size: int, init_method: str | None, total_steps: int | None) -> None:
        from megatron.core.distributed import finalize_model_grads

        from miles_lite.trainer.model import resolve_runtime

        trainer = self.cfg.trainer
        self.runtime = resolve_runtime(trainer)
        self.logprob_options = LogprobOptions.of(trainer)
        if trainer.threads < 0:
            raise ValueError(f"trainer.threads={trainer.threads} must be >= 0 (0 keeps torch's default)")
        if self.runtime.device == "cpu" and trainer.threads:
            # Intra-op threads busy-wait between ops; on cores shared with engines that costs more than it saves.
            torch.set_num_threads(trainer.threads)
        self.par: ParallelInfo = init_parallel(trainer, rank, world_size, self.runtime.device, init_method)
        with cpu_compat.device_mode():
            spec, hf_state, self.hf_config = load_policy_source(self.cfg.model)
            self.policy, self.layouts = build_handle(spec, hf_state, trainer, self.runtime, self.par)
            del hf_state
            # What the optimizer steps and checkpoints hold: the whole model, or only its LoRA adapters.
            self.lora = attach_lora(self.policy, trainer, self.par)
            self.trained: torch.nn.Module = self.lora if self.lora is not None else self.policy.model
            self.trained_layouts = self.lora.layouts() if self.lora is not None else self.layouts
            if self.lora is not None:
                mark_tensor_parallel(self.lora, self.trained_layouts)
            self.ddp = wrap_ddp(self.trained, self.policy.model.config, trainer, self.runtime)
            self._finalize_grads = finalize_model_grads
            self.optimizer = build_optimizer(self.ddp, trainer, self.runtime)
            self.scheduler = build_scheduler(self.optimizer, trainer, total_steps or self.cfg.steps)
            self.guard = UpdateGuard(self.optimizer, trainer.max_update_ratio) if trainer.max_update_ratio > 0 else None
            self.offloader = actor_offload(self)
            self.reference: dict[str, Tensor] | None = None
            if (trainer.keep_reference or self.cfg.algo.kl_coef > 0) and self.lora is None:
                # (A LoRA run's reference is its frozen base: the adapters switched off.)
                # Host copy of the initial weights; swapped into the policy model when asked for.
                self.reference = {n: p.detach().to("cpu", copy=True)
                                  for n, p in self.policy.model.named_parameters()}
            self.routing: ModelRouting | None = None
            if spec.is_moe:
                self.routing = ModelRouting(self.policy.model, spec.moe_layer_ids, not spec.norm_topk_prob,
                                            spec.num_experts, spec.moe_top_k)
            elif trainer.routing_replay:
                raise ValueError(f"trainer.routing_replay=true needs a mixture-of-experts model; {spec.arch} is "
                                 "dense: set trainer.routing_replay=false")
            self.teacher: ModelHandle | None = None
            teacher_src = load_teacher_source(self.cfg.teacher_path)
            if teacher_src is not None:
                t_spec, t_state = teacher_src
                self.teacher, _ = build_handle(t_spec, t_state, trainer, self.runtime, self.par)
                self.teacher.model.requires_grad_(False)

    # ---- lifecycle ------------------------------------------------------------------------------

    def _require_ready(self) -> None:
        if self.state is not ActorState.READY:
            raise RuntimeError(f"TrainerActor is {self.state.value}; only a ready actor can run this call")

    def close(self) -> None:
        """Leave megatron's groups, and the process group if this actor created it (idempotent)."""
        if self.state is ActorState.CLOSED:
            return
        shutdown_parallel(self.par)
        self.state = ActorState.CLOSED

    # ---- batches --------------------------------------------------------------------------------

    def _route(self, mb: PackedMicroBatch, batch: TrainBatch, replay: bool = True) -> None:
        """Point the policy's MoE routers at `mb`: its real tokens and, with `trainer.routing_replay`, the
        rollout's experts for its generated tokens (see routing.py)."""
        if self.routing is not None:
            self.routing.set_micro_batch(mb, batch.routed_experts, not self.runtime.packed_thd,
                                         replay and self.cfg.trainer.routing_replay)

    def _check_tokens(self, batch: TrainBatch) -> None:
        if batch.routed_experts is not None and self.routing is not None:
            spec = self.policy.spec
            check_routed(batch.routed_experts, batch.response_lengths, len(spec.moe_layer_ids), spec.moe_top_k,
                         spec.num_experts)
        vocab = self.policy.spec.vocab_size
        for i, seq in enumerate(batch.tokens):
            if seq and (min(seq) < 0 or max(seq) >= vocab):
                raise ValueError(f"TrainBatch.tokens[{i}] has ids outside [0, {vocab}) (the model's vocab_size)")

    def _check_replayable(self, batch: TrainBatch) -> None:
        """With routing replay, every generated sequence must carry the experts the engine routed it to: without
        them its tokens would silently route themselves (an engine started without SGLang's
        --enable-return-routed-experts answers with none)."""
        if not self.cfg.trainer.routing_replay or self.routing is None:
            return
        routed = batch.routed_experts
        missing = [i for i, r in enumerate(batch.response_lengths) if r > 1 and (routed is None or routed[i] is None)]
        if missing:
            raise ValueError(f"trainer.routing_replay=true, but {len(missing)} of the batch's {batch.num_sequences} "
                             "sequences came back from the engines without routed experts: SGLang engines return them "
                             "only when started with --enable-return-routed-experts (engines the run starts get it; "
                             "engines started elsewhere, rollout.engine_urls, need it themselves), or set "
                             "trainer.routing_replay=false")

    def _micro_batches(self, batch: TrainBatch) -> list[PackedMicroBatch]:
        """This data-parallel rank's share of `batch`, grouped by `trainer.micro_batch_tokens` (padding
        included on the local spec, whose micro-batches run as padded batches: see packing.py)."""
        lengths = [len(t) for t in batch.tokens]
        mine = split_for_data_parallel(lengths, self.par.dp_size)[self.par.dp_rank]
        plan = plan_micro_batches([lengths[i] for i in mine], self.cfg.trainer.micro_batch_tokens,
                                  padded=not self.runtime.packed_thd)
        mbs = [pack(batch.tokens, batch.prompt_lengths, [mine[j] for j in group]) for group in plan]
        if needs_alignment(self.par.ep_size, self.par.dp_size):
            mbs = align_micro_batches(mbs, not self.runtime.packed_thd, None, self.policy.device)
        return mbs

    def _gather_dp(self, local: Any) -> list[Any]:
        if self.par.dp_group is None:
            return [local]
        out: list[Any] = [None] * self.par.dp_size
        dist.all_gather_object(out, local, group=self.par.dp_group)
        return out

    # ---- log-probs ------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: str = "policy", quantized: bool = True) -> list[list[float]]:
        """Log-probs (nats) of every sequence's response tokens under `model`.

        Args:
            batch: sequences; only `tokens` and `prompt_lengths` are read.
            model: "policy" (current weights), "reference" (initial weights; needs `algo.kl_coef > 0`
                or `trainer.keep_reference`) or "teacher" (`experiment.teacher_path`; its softmax is
                trimmed to the vocabulary it shares with the policy).
            quantized: False runs an FP8 model in its weights' own dtype (no effect otherwise): the
                weight-push probe compares weights, not FP8 noise.

        Returns:
            One list of R_i floats per sequence, identical on every rank.
        """
        self._require_ready()
        self.offloader.require_resident(("params",), "computing log-probs")
        if model not in MODELS:
            raise ValueError(f"model={model!r} is not one of {', '.join(MODELS)}")
        self._check_tokens(batch)
        handle, vocab = self.policy, None
        swap: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if model == "reference" and self.lora is not None:
            swap = self.lora.disabled()
        elif model == "reference":
            if self.reference is None:
                raise RuntimeError("no reference model: set trainer.keep_reference=true or algo.kl_coef > 0")
            swap = self._swapped_weights(self.reference)
        elif model == "teacher":
            if self.teacher is None:
                raise RuntimeError("no teacher model: set experiment.teacher_path to an HF checkpoint directory")
            handle, vocab = self.teacher, min(self.teacher.spec.vocab_size, self.policy.spec.vocab_size)
        local: dict[int, list[float]] = {}
        precision = contextlib.nullcontext() if quantized else fp8_off(handle.model.config)
        with cpu_compat.compute_mode(), swap, precision:
            handle.model.eval()
            # TE caches FP8 copies of the weights after the first micro-batch; the weights may have
            # changed since the last call (optimizer step, weight load), so re-quantize them.
            handle.model.set_is_first_microbatch()
            for mb in self._micro_batches(batch):
                self._route(mb, batch, replay=handle is self.policy)
                lp, _ = response_logprobs(handle, mb, self.logprob_options, False, vocab)
                if mb.filler:
                    continue
                for i, part in zip(mb.seq_indices, lp.split(list(mb.response_lengths)), strict=True):
                    local[i] = part.float().cpu().tolist()
        merged: dict[int, list[float]] = {}
        for part in self._gather_dp(local):
            merged.update(part)
        return [merged[i] for i in range(batch.num_sequences)]

    @contextlib.contextmanager
    def _swapped_weights(self, weights: Mapping[str, Tensor]) -> Iterator[None]:
        params = dict(self.policy.model.named_parameters())
        saved = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        try:
            for n, p in params.items():
                p.data.copy_(weights[n])
            yield
        finally:
            for n, p in params.items():
                p.data.copy_(saved[n])

    # ---- optimizer steps ------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, distill_coef: float | None = None) -> dict[str, float]:
        """RL optimizer steps on `batch`: `algo.updates_per_rollout` mini-batches, `algo.epochs_per_rollout` times.

        With one step in all, the "old" policy of the PPO ratio is the trainer itself (`logp.detach()`,
        ratio 1). With more, the policy's log-probs are computed once before the first step and every
        step's ratio is taken against them, so later steps clip (`policy/clip_frac`). The LR schedule
        advances once per call (per rollout batch), whatever the number of steps. Reference / teacher
        log-probs are computed here when the loss needs them and the batch lacks them. `distill_coef`
        overrides `algo.distill_coef` for this batch (the RL phase after an OPD warm-up passes 0).

        Returns float stats (identical on every rank): loss terms, policy and mismatch metrics, entropy
        and grad_norm averaged over the steps (`*_max` / `*_min` over all of them), `policy/updates`,
        `policy/clip_frac`, `policy/ratio_spread` (max - min ratio), lr, tokens, tokens_per_s, skipped
        (steps skipped as non-finite), nonfinite_total.
        """
        t0 = time.perf_counter()
        self._require_ready()
        self._check_tokens(batch)
        self._check_replayable(batch)
        algo = self.cfg.algo
        if distill_coef is not None and distill_coef != algo.distill_coef:
            algo = dataclasses.replace(algo, distill_coef=distill_coef)
        ref = batch.ref_logprobs
        if algo.kl_coef and ref is None:
            ref = self.compute_logprobs(batch, "reference")
        teacher = batch.teacher_logprobs
        if algo.distill_coef and teacher is None:
            teacher = self.compute_logprobs(batch, "teacher")
        plan = minibatch_plan(batch.num_sequences, algo.updates_per_rollout, algo.epochs_per_rollout,
                              seed=self.cfg.trainer.seed + self.steps_done)
        old = batch.old_logprobs
        if len(plan) > 1 and old is None:
            old = self.compute_logprobs(batch, "policy")
        full = dataclasses.replace(batch, ref_logprobs=ref, teacher_logprobs=teacher, old_logprobs=old)
        t0 = time.perf_counter()
        per_update = []
        for k, indices in enumerate(plan):
            part = full if len(plan) == 1 else full.subset(indices)
            per_update.append(self._rl_update(part, algo, advance_schedule=k == len(plan) - 1))
        return combine_update_stats(per_update, batch, time.perf_counter() - t0)

    def _rl_update(self, batch: TrainBatch, algo: AlgoConfig, advance_schedule: bool) -> dict[str, float]:
        """One optimizer step on `batch` (its own ref / teacher / old log-probs, if any)."""
        totals = BatchTotals.of(batch)

        def micro_loss(mb: PackedMicroBatch) -> tuple[Tensor, DeviceStats, float]:
            # The entropy enters the loss only with algo.entropy_coef != 0; otherwise it is a statistic
            # and the log-prob backward skips its gradient term.
            lp, ent = response_logprobs(self.policy, mb, self.logprob_options, with_entropy=True)
            loss, stats = rl_micro_loss(lp, ent, mb, batch, algo, batch.ref_logprobs, batch.teacher_logprobs)
            return loss, stats, totals.share(mb, algo.agg_mode)

        return self._step(batch, micro_loss, lr=None, advance_schedule=advance_schedule)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on the response tokens.

        Args:
            batch: `tokens` / `prompt_lengths` (rollout log-probs and advantages are ignored).
            lr: learning rate for this step (None: the RL schedule's current LR); the RL schedule
                is not advanced.
        """
        self._require_ready()
        self._check_tokens(batch)
        totals = BatchTotals.of(batch)

        def micro_loss(mb: PackedMicroBatch) -> tuple[Tensor, DeviceStats, float]:
            lp, _ = response_logprobs(self.policy, mb, self.logprob_options, with_entropy=False)
            loss, stats = sft_micro_loss(lp, mb, batch)
            return loss, stats, totals.share(mb, "token_mean")

        return self._step(batch, micro_loss, lr=lr)

    def _all_finite(self, parts: list[tuple[float, dict[str, float]]]) -> bool:
        """True when every rank's losses and gradients are finite (one all-reduce over the world)."""
        ok = all(torch.isfinite(torch.tensor(s.get("loss/total", s.get("loss/sft", 0.0)))) for _, s in parts)
        # One reduction per contiguous DDP grad buffer and a single host sync: a per-parameter
        # `bool(isfinite(...).all())` costs one device sync per tensor (~15 ms per step on a GPU).
        grads = [buf.grad_data for buf in getattr(self.ddp, "buffers", [])]
        if not grads:
            grads = [g for p in self.policy.model.parameters()
                     if (g := p.main_grad if getattr(p, "main_grad", None) is not None else p.grad) is not None]
        grads_ok = all_finite(grads)
        flag = torch.tensor([0.0 if ok else 1.0], device=self.policy.device)
        flag = torch.where(grads_ok.to(flag.device), flag, torch.ones_like(flag))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def _step(self, batch: TrainBatch, micro_loss: MicroLoss, lr: float | None,
              advance_schedule: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        # The optimizer state may still be coming back from host memory: the optimizer step waits for it (below).
        self.offloader.ready_on_device(("params", "grads"), "an optimizer step")
        self.offloader.check_resident(("optimizer",), "an optimizer step")
        queued: list[tuple[float, DeviceStats]] = []
        routing_stats: RoutingStats | None = self.routing.new_stats() if self.routing is not None else None
        with cpu_compat.device_mode():
            self.policy.model.train()
            # Without this, TE's FP8 layers keep using the weights quantized at the first forward ever.
            self.policy.model.set_is_first_microbatch()
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        with cpu_compat.compute_mode():
            for mb in self._micro_batches(batch):
                self._route(mb, batch)
                loss, stats, share = micro_loss(mb)
                if self.routing is not None and routing_stats is not None and not mb.filler:
                    self.routing.accumulate(routing_stats)
                if mb.filler:
                    # Expert parallelism: run the backward's collectives, add nothing.
                    (loss * 0.0).backward()
                    continue
                # DDP averages gradients over DP ranks; the shares already sum to 1 over all ranks.
                (loss * (share * self.par.dp_size)).backward()
                queued.append((share, stats))
        with cpu_compat.device_mode():
            if self.policy.spec.is_moe:
                scale_expert_grads(self.ddp, self.par.tp_size)
            self._finalize_grads([self.ddp])
            # Every micro-batch's statistics in one host read, once all the step's kernels are queued: a read
            # per statistic would make the host wait for the device before each backward.
            parts = list(zip([share for share, _ in queued], read_many([stats for _, stats in queued]), strict=True))
            all_parts = [p for rank_parts in self._gather_dp(parts) for p in rank_parts]
            stats = reduce_stats(all_parts)
            if self.routing is not None and routing_stats is not None:
                routing_stats.reduce()
                stats.update(routing_stats.metrics(self.routing.layer_ids, self.routing.top_k))
                self.routing.clear()
            stats["lr"] = self._set_step_lr(lr)
            if not self._all_finite(parts):
                self._skip_nonfinite()
                stats.update(skipped=1.0, grad_norm=float("nan"))
            else:
                stats.update(self._apply_step(lr, advance_schedule))
        elapsed = time.perf_counter() - t0
        stats.update(
            tokens=float(batch.num_tokens),
            response_tokens=float(sum(batch.response_lengths)),
            loss_tokens=float(sum(batch.loss_token_counts)),
            tokens_per_s=batch.num_tokens / max(elapsed, 1e-9),
            step_time_s=elapsed,
            nonfinite_total=float(self.nonfinite_total),
            diverged_total=float(self.diverged_total),
        )
        return stats

    def _set_step_lr(self, lr: float | None) -> float:
        """Set the rate of the coming optimizer step and return it: `lr`, or the schedule's (RL steps)."""
        if lr is not None:
            set_lr(self.optimizer, lr)
        else:
            # The schedule's rate, set again: a step at a rate of its own (the SFT warm-up's) leaves that rate
            # in the optimizer, and the first RL step after it would run at it.
            self.scheduler.step(increment=0)
        return current_lr(self.optimizer)

    def _apply_step(self, lr: float | None, advance_schedule: bool) -> dict[str, float]:
        """The optimizer step (and the RL schedule's), undone when the update guard finds it diverged."""
        self.offloader.ready_on_device(("optimizer",), "an optimizer step")
        if self.guard is not None:
            self.guard.prepare()
        _, grad_norm, _ = self.optimizer.step()
        out = {"skipped": 0.0, "grad_norm": float(grad_norm or 0.0)}
        if self.guard is not None:
            check = self.guard.check()
            out["update_ratio_bound"] = check.bound
            if check.ratio is not None:  # measured only when the bound could not rule divergence out
                out["update_ratio"] = check.ratio
            if check.diverged:
                self.guard.restore()
                if is_distributed(self.optimizer):
                    # Each rank restored its own range of the weights: gather the others' again.
                    self.ddp.start_param_sync(force_sync=True)
                self._skip_diverged(check.ratio)
                out["skipped"] = 1.0
                return out
        if lr is None and advance_schedule:
            self.scheduler.step(increment=1)
        self.steps_done += 1
        self.nonfinite_in_a_row = 0
        self.diverged_in_a_row = 0
        return out

    def _skip_diverged(self, ratio: float) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.diverged_in_a_row += 1
        self.diverged_total += 1
        limit = self.cfg.trainer.max_diverged_skips
        if self.diverged_in_a_row >= limit:
            raise DivergedStepError(
                f"{self.diverged_in_a_row} optimizer steps in a row moved the weights by {ratio:.3g} of their norm "
                f"(trainer.max_update_ratio={self.cfg.trainer.max_update_ratio:g}, trainer.max_diverged_skips="
                f"{limit}); each was undone, the weights are those of the last good step. Lower trainer.lr "
                "(or experiment.warmup_lr), or raise trainer.max_update_ratio if such steps are intended"
            )

    def _skip_nonfinite(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        limit = self.cfg.trainer.max_nonfinite_skips
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteStepError(
                f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(trainer.max_nonfinite_skips={limit}); the weights are untouched since the last finite step. "
                "Check advantages/rewards for NaN, lower trainer.lr, or use trainer.precision=fp32"
            )
