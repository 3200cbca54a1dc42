"""Continuous batching for the reference engine: requests join and leave a shared decode batch step by step.

One scheduler task owns the batch. Each iteration it either prefills newly admitted requests (as one padded
batch, then merges them into the running batch) or decodes tokens for every running request. Model work
runs on a single worker thread, so the event loop keeps answering HTTP (aborts, health, load) during a step,
and weight updates queued on the same thread land between steps.

A decode call runs a burst of up to `DECODE_BURST` steps on the model thread: it stops after the first step
that would finish any request (end of sequence, a stop token, its token budget or the context) and as soon as
the loop has something for the model (a new request or probe, an abort, a pause, a weight update: `_interrupt`).
The loop then accepts the burst's tokens step by step, exactly as it would have accepted them one step at a
time; what a burst saves is the round trip through the event loop per token (a thread hop, a future, the
loop's bookkeeping), which on a small model cost more than the model. Requests with stop strings decode one
step per call (a stop string is seen only in decoded text).

Request lifecycle: WAITING -> RUNNING -> FINISHED, or WAITING/RUNNING -> FINISHED by abort; `retract` pauses
send RUNNING requests back to WAITING (their KV cache is recomputed, with the then-current weights, on resume).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from miles_lite.engines.reference.model import KVBatch, ReferenceModel
from miles_lite.engines.reference.routing import encode_routed
from miles_lite.engines.reference.sampling import RequestSampling, make_generator, sample_next

# Decode steps one model-thread call runs at most (see the module docstring).
DECODE_BURST = 64


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PauseMode(enum.Enum):
    """SGLang's `/pause_generation` modes."""

    ABORT = "abort"  # abort everything in flight (SGLang's default)
    IN_PLACE = "in_place"  # running requests keep their KV cache and wait
    RETRACT = "retract"  # running requests go back to the queue; their KV cache is recomputed on resume


@dataclass(eq=False)
class GenRequest:
    """One `/generate` request as the scheduler tracks it."""

    rid: str
    input_ids: list[int]
    sampling: RequestSampling
    return_logprob: bool
    # SGLang's logprob_start_len: -1 = no input logprobs, else the first input position reported.
    logprob_start_len: int
    future: asyncio.Future
    # Health probes run even while generation is paused and never join the shared batch.
    probe: bool = False
    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    created: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    # SGLang's `return_routed_experts` (MoE models): the expert ids of every position the model ran.
    return_routed_experts: bool = False
    routed: list[np.ndarray] = field(default_factory=list)

    # The LoRA adapter the request named (`lora_path`), held for its whole life; None: the base model.
    adapter: Any = None

    def __post_init__(self) -> None:
        self.generator = make_generator(self.sampling.sampling_seed)


class Scheduler:
    """Owns the waiting queue, the running batch and the model worker thread."""

    def __init__(self, model: ReferenceModel, max_batch_size: int, weight_version: Callable[[], str],
                 tokenizer: Any | None = None, original_logprob: bool = False) -> None:
        if max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {max_batch_size}")
        self.model = model
        self.max_batch_size = max_batch_size
        self._weight_version = weight_version
        self._tokenizer = tokenizer
        self._original_logprob = original_logprob
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-model")
        self._waiting: deque[GenRequest] = deque()
        self._probes: deque[GenRequest] = deque()
        self._running: list[GenRequest] = []
        # Requests of the step now on the model thread that are not (yet) in `_running`.
        self._inflight: list[GenRequest] = []
        self._batch: KVBatch | None = None
        self._by_rid: dict[str, GenRequest] = {}
        self._paused = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Set by the loop when it needs the model thread (see the module docstring): a burst ends at it.
        self._interrupt = threading.Event()

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduling task on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="reference-scheduler")

    async def close(self) -> None:
        """Abort everything, stop the task and the model thread."""
        self.abort(None, message="Server shutting down")
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def run_on_model(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the model thread, after the step now running there (a decode burst ends early)."""
        self._interrupt.set()
        return await self._on_model(fn, *args)

    async def _on_model(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # ---- requests --------------------------------------------------------------------------------------------

    def validate_prompt(self, input_ids: list[int]) -> None:
        """Raise ValueError if `input_ids` cannot be served (empty, out of vocabulary, too long)."""
        if not input_ids:
            raise ValueError("input_ids is empty; send at least one token id")
        vocab = self.model.vocab_size
        bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(input_ids) >= self.model.max_positions:
            raise ValueError(f"input_ids has {len(input_ids)} tokens; the model's context is "
                             f"{self.model.max_positions}")

    async def submit(self, req: GenRequest) -> dict[str, Any]:
        """Queue a request and wait for its SGLang-shaped `/generate` answer."""
        if not req.probe:
            if req.rid in self._by_rid:
                raise ValueError(f"Duplicate request ID {req.rid!r} is already in flight")
            self._by_rid[req.rid] = req
        (self._probes if req.probe else self._waiting).append(req)
        self._interrupt.set()
        self._wake.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            # The client went away: stop spending decode steps on the request.
            self._finish(req, {"type": "abort", "message": "client disconnected", "status_code": None,
                               "err_type": None})
            raise
        finally:
            if self._by_rid.get(req.rid) is req:
                del self._by_rid[req.rid]

    def abort(self, rid: str | None, message: str = "Aborted by request") -> int:
        """Finish one request (`rid`) or all (None) with finish reason abort; returns how many were aborted."""
        targets = list(self._by_rid.values()) if rid is None else [r for r in [self._by_rid.get(rid)] if r]
        for req in targets:
            self._finish(req, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        self._interrupt.set()
        self._wake.set()
        return len(targets)

    def pause(self, mode: PauseMode) -> None:
        """Stop scheduling new work; see `PauseMode` for what happens to requests in flight."""
        self._paused = True
        self._interrupt.set()
        if mode is PauseMode.ABORT:
            self.abort(None)
        elif mode is PauseMode.RETRACT:
            for req in reversed(self._running):
                if req.state is ReqState.RUNNING:
                    req.state = ReqState.WAITING
                    self._waiting.appendleft(req)
            self._running, self._batch = [], None

    def resume(self) -> None:
        """Continue after `pause`."""
        self._paused = False
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, Any]:
        """SGLang's `/get_load` fields for this (single data-parallel rank) engine."""
        tokens = sum(len(r.input_ids) + len(r.output_ids) for r in self._running)
        waiting = sum(1 for r in self._waiting if r.state is ReqState.WAITING)
        return {"dp_rank": 0, "num_reqs": len(self._running), "num_waiting_reqs": waiting,
                "num_tokens": tokens, "ts_tic": time.time()}

    # ---- the loop --------------------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._probes) or (not self._paused and bool(self._waiting or self._running))

    async def _loop(self) -> None:
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step()
            except Exception as exc:  # a failed forward fails the requests it carried, not the server
                for req in [*self._running, *self._inflight]:
                    if not req.future.done():
                        req.future.set_exception(RuntimeError(f"model step failed: {exc!r}"))
                    req.state = ReqState.FINISHED
                self._running, self._batch = [], None
            finally:
                self._inflight = []

    async def _step(self) -> None:
        self._drop_finished()
        if self._probes:
            probes = [self._probes.popleft() for _ in range(len(self._probes))]
            await self._prefill(probes, join=False)
        if self._paused:
            return
        room = self.max_batch_size - len(self._running)
        admitted: list[GenRequest] = []
        while self._waiting and len(admitted) < room:
            req = self._waiting.popleft()
            if req.state is ReqState.WAITING:
                admitted.append(req)
        if admitted:
            await self._prefill(admitted, join=True)
        elif self._running:
            await self._decode()

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._running) if r.state is ReqState.RUNNING]
        if len(keep) != len(self._running):
            self._batch = ReferenceModel.select(self._batch, keep) if self._batch is not None else None
            self._running = [self._running[i] for i in keep]

    def _banned(self, req: GenRequest, produced: int | None = None) -> frozenset[int]:
        if (len(req.output_ids) if produced is None else produced) >= req.sampling.min_new_tokens:
            return frozenset()
        eos = frozenset() if req.sampling.ignore_eos else self.model.eos_token_ids
        return eos | req.sampling.stop_token_ids

    def _prefill_compute(self, reqs: list[GenRequest], starts: list[int | None]):
        with self.model.lora.rows([r.adapter for r in reqs]):
            result = self.model.prefill([r.input_ids + r.output_ids for r in reqs], starts)
        tokens, logprobs = sample_next(result.next_logits, [r.sampling for r in reqs], [r.generator for r in reqs],
                                       [self._banned(r) for r in reqs], self._original_logprob)
        return result, tokens, logprobs

    async def _prefill(self, reqs: list[GenRequest], join: bool) -> None:
        self._inflight = reqs
        for req in reqs:
            req.state = ReqState.RUNNING
        starts = [r.logprob_start_len if r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None
                  else None for r in reqs]
        result, tokens, logprobs = await self._on_model(self._prefill_compute, reqs, starts)
        keep: list[int] = []
        for i, req in enumerate(reqs):
            if result.input_logprobs[i] is not None:
                req.input_logprobs = result.input_logprobs[i]
            if req.return_routed_experts and result.routed is not None:
                req.routed = [result.routed[i]]  # every position so far (a resumed request runs them again)
            if req.state is not ReqState.RUNNING:
                continue  # aborted during the step
            if req.sampling.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            if self._accept(req, tokens[i], logprobs[i]):
                if join:
                    keep.append(i)
                else:  # probes answer after one token whatever they asked for
                    self._finish(req, {"type": "length", "length": len(req.output_ids)})
        if join and keep:
            self._batch = ReferenceModel.merge(self._batch, ReferenceModel.select(result.batch, keep))
            self._running.extend(reqs[i] for i in keep)

    def _decode_burst(self, reqs: list[GenRequest], batch: KVBatch) -> tuple[KVBatch, list[tuple]]:
        """Decode steps on the model thread until one would finish a request, the loop interrupts, or
        `DECODE_BURST` steps; returns the batch and each step's (tokens, logprobs, routed experts)."""
        last = [r.output_ids[-1] for r in reqs]
        done = [len(r.output_ids) for r in reqs]
        bursts = 1 if any(r.sampling.stop for r in reqs) else DECODE_BURST
        steps: list[tuple] = []
        with self.model.lora.rows([r.adapter for r in reqs]):
            for _ in range(bursts):
                batch, logits = self.model.decode(batch, last)
                tokens, logprobs = sample_next(logits, [r.sampling for r in reqs], [r.generator for r in reqs],
                                               [self._banned(r, n) for r, n in zip(reqs, done, strict=True)],
                                               self._original_logprob)
                steps.append((tokens, logprobs, self.model.last_decode_routed))
                done = [n + 1 for n in done]
                if self._interrupt.is_set() or any(self._stops(r, t, n) for r, t, n in zip(reqs, tokens, done,
                                                                                          strict=True)):
                    break
                last = tokens
        return batch, steps

    async def _decode(self) -> None:
        reqs, batch = list(self._running), self._batch
        self._interrupt.clear()
        new_batch, steps = await self._on_model(self._decode_burst, reqs, batch)
        if reqs != self._running:
            return  # a retract pause dropped the batch while the step ran: discard this step's tokens
        self._batch = new_batch
        for tokens, logprobs, routed in steps:
            for i, req in enumerate(reqs):
                if req.return_routed_experts and routed is not None and req.state is ReqState.RUNNING:
                    req.routed.append(routed[i][None])
            for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
                if req.state is ReqState.RUNNING:
                    self._accept(req, tok, lp)

    def _stops(self, req: GenRequest, token: int, length: int) -> bool:
        """Whether `_accept` would finish `req` on `token` as its `length`-th output (stop strings aside)."""
        sp = req.sampling
        return ((not sp.ignore_eos and token in self.model.eos_token_ids) or token in sp.stop_token_ids
                or length >= sp.max_new_tokens or len(req.input_ids) + length >= self.model.max_positions)

    def _accept(self, req: GenRequest, token: int, logprob: float) -> bool:
        """Append a sampled token, finish the request if a stop condition holds; True if it keeps running."""
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        sp = req.sampling
        reason: dict[str, Any] | None = None
        if not sp.ignore_eos and token in self.model.eos_token_ids:
            reason = {"type": "stop", "matched": token}
        elif token in sp.stop_token_ids:
            reason = {"type": "stop", "matched": token}
        elif sp.stop and self._tokenizer is not None:
            text = self._tokenizer.decode(req.output_ids)
            matched = next((s for s in sp.stop if s in text), None)
            if matched is not None:
                reason = {"type": "stop", "matched": matched}
        if reason is None and len(req.output_ids) >= sp.max_new_tokens:
            reason = {"type": "length", "length": sp.max_new_tokens}
        if reason is None and len(req.input_ids) + len(req.output_ids) >= self.model.max_positions:
            reason = {"type": "length", "length": len(req.output_ids)}
        if reason is not None:
            self._finish(req, reason)
            return False
        return True

    def _finish(self, req: GenRequest, reason: dict[str, Any]) -> None:
        if req.state is ReqState.FINISHED:
            return
        req.state = ReqState.FINISHED
        if not req.future.done():
            req.future.set_result(self._response(req, reason))
        self._wake.set()

    def _response(self, req: GenRequest, reason: dict[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self._weight_version(),
            "e2e_latency": time.monotonic() - req.created,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, req.output_ids,
                                                                              strict=True)]
            inputs: list[list[Any]] = []
            if req.logprob_start_len >= 0 and req.input_logprobs is not None:
                tail = req.input_ids[req.logprob_start_len:]
                inputs = [[lp, t, None] for lp, t in zip(req.input_logprobs, tail, strict=True)]
            meta["input_token_logprobs"] = inputs
        if req.return_routed_experts and req.routed:
            fed = len(req.input_ids) + len(req.output_ids) - 1  # the last sampled token never ran
            meta["routed_experts"] = encode_routed(np.concatenate(req.routed)[:fed])
        return {"output_ids": list(req.output_ids), "meta_info": meta}
