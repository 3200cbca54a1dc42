"""RolloutManager: sample groups of completions over the engine fleet, surviving engine faults.

Each (prompt, sample) pair is a *slot* filled exactly once by one task. The task reserves the
healthy engine with the fewest outstanding requests, sends the request, and on an error or a
timeout re-sends it to another engine (at most `fault_tolerance.request_retries` times), so a dead
engine costs latency, never a completion. A request that comes back aborted keeps its partial
tokens; the slot later continues from prompt + partial tokens (possibly under newer weights, which
the sample's `weight_version` records as "3+4").

Lifecycle of one manager: IDLE -> RUNNING (one `generate_groups` call) -> IDLE, or
RUNNING -> ABORTING -> IDLE when `abort()` stops the call for a weight update: the call then
returns the groups already complete and keeps the others, partial outputs included, to finish
first in the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.plugins import PluginFailed, PluginPool
from miles_lite.rollout.environment import ToolEnvironment, start_trajectory
from miles_lite.rollout.fleet import EngineFleet, EngineLease
from miles_lite.rollout.generate_plugin import GenerateFn, GenerateResult, Interrupted, SlotClient
from miles_lite.rollout.prompt_spec import PromptLike, PromptSpec, as_prompt_spec, sampling_from_config
from miles_lite.rollout.routing import RoutingLayout
from miles_lite.rollout.slots import (
    MIXED_SEPARATOR,
    ManagerState,
    PendingGroup,
    RolloutError,
    RolloutStats,
    Slot,
    is_mixed_version,
    joined,
    slot_seed,
)
from miles_lite.types import Group, Sample, SamplingParams

# Names the rest of the package imports from here.
__all__ = ["MIXED_SEPARATOR", "ManagerState", "PromptSource", "RolloutError", "RolloutManager", "RolloutStats",
           "Scorer", "is_mixed_version"]

logger = logging.getLogger(__name__)

# How HttpEngine reports an answer "400 Bad Request"-like: the request, not the engine, is at fault.
_BAD_REQUEST = re.compile(r"HTTP (?:400|404|405|413|422)\b")

Scorer = Callable[[list[Group]], None]
PromptSource = Callable[[int], Sequence[PromptLike]]


class RolloutManager:
    """Fans groups of samples over the fleet's healthy engines; see the module docstring."""

    def __init__(
        self,
        fleet: EngineFleet,
        rollout_cfg: RolloutConfig,
        ft_cfg: FaultToleranceConfig,
        *,
        decode: Callable[[list[int]], str] | None = None,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        encode: Callable[[str], list[int]] | None = None,
        environment: ToolEnvironment | None = None,
        generate_fn: GenerateFn | None = None,
        group_filter: Callable[[Group], bool] | None = None,
        routing: RoutingLayout | None = None,
        plugins: PluginPool | None = None,
    ) -> None:
        """`decode` turns response ids into text for rewards and the table (None: text stays "").

        `stop_token_ids` (e.g. the tokenizer's EOS) and `seed` go into the default sampling params.
        With a tool `environment` (multi-turn rollouts), `encode` tokenises its replies and `decode` reads
        the model's turns; see `miles_lite.rollout.environment`. With a MoE `routing` layout, requests ask for
        the routed experts and samples carry them (`Sample.routed_experts`). `plugins`: the pool the environment's
        blocking calls run in (default: threads, `rollout.plugin_workers` / `plugin_timeout_s`), so a slow tool
        delays its own trajectory only.
        """
        self.routing = routing
        if environment is not None and generate_fn is not None:
            raise ValueError("rollout.environment and rollout.generate_fn exclude each other: a generate plug-in "
                             "runs its own turns")
        if (environment is not None or generate_fn is not None) and (encode is None or decode is None):
            raise ValueError("a tool environment needs encode= and decode= (it reads turns and tokenises replies)")
        if environment is not None and rollout_cfg.max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {rollout_cfg.max_turns}")
        if ft_cfg.request_retries < 0:
            raise ValueError(f"fault_tolerance.request_retries must be >= 0, got {ft_cfg.request_retries}")
        if rollout_cfg.request_timeout_s <= 0:
            raise ValueError(f"rollout.request_timeout_s must be > 0, got {rollout_cfg.request_timeout_s}")
        if rollout_cfg.max_sampling_rounds < 1:
            raise ValueError(f"rollout.max_sampling_rounds must be >= 1, got {rollout_cfg.max_sampling_rounds}")
        self.fleet = fleet
        self.cfg = rollout_cfg
        self.ft = ft_cfg
        self.decode = decode
        self.encode = encode
        self.environment = environment
        self.generate_fn = generate_fn
        self.plugins = plugins or PluginPool(rollout_cfg.plugin_workers, "threads", rollout_cfg.plugin_timeout_s)
        # The agent plug-in's slots (`rollout/agent_slots.py`), set by whoever starts the gateway; None: no agent.
        self.agents: Any = None
        # Dynamic sampling keeps the groups this accepts (default: rewards that differ).
        self.group_filter = group_filter or (lambda group: not group.is_zero_signal)
        self._filter_is_plugin = group_filter is not None
        self.default_sampling = sampling_from_config(rollout_cfg, stop_token_ids=stop_token_ids, seed=seed)
        self.state = ManagerState.IDLE
        self.last_stats = RolloutStats()
        self._carry: list[PendingGroup] = []
        self._tasks: dict[asyncio.Task[None], Slot] = {}
        self._idle: asyncio.Event | None = None
        self._calls = 0
        self._request_ids = itertools.count()

    @property
    def pending_groups(self) -> int:
        """Groups kept by an abort; the next `generate_groups` call finishes them first."""
        return len(self._carry)

    # ------------------------------------------------------------------ public API

    async def generate_groups(
        self,
        prompts: Sequence[PromptLike],
        group_size: int | None = None,
        sampling: SamplingParams | None = None,
        *,
        scorer: Scorer | None = None,
        more_prompts: PromptSource | None = None,
        target: int | None = None,
        max_rounds: int | None = None,
    ) -> list[Group]:
        """Sample `group_size` completions for each prompt; returns one complete `Group` per prompt.

        Groups carried over from an aborted call come first, then the new prompts in order. With
        `scorer`, every group is scored (it fills `sample.rewards`) before it is returned. With
        `rollout.dynamic_sampling` and a `more_prompts` source (the RL stream; evaluation and presample
        calls pass none and are never refilled), zero-std groups are dropped and `more_prompts(n)` is asked for
        new prompts, for up to `max_rounds` rounds (default `rollout.max_sampling_rounds`); at most
        `target` groups (default: as many as were carried and asked for) are returned, fewer if the
        rounds run out. If `abort()` interrupts the call, only the groups complete by then are
        returned. Stats of the call: `self.last_stats`.
        """
        if self.state is not ManagerState.IDLE:
            raise RuntimeError(f"generate_groups called while the manager is {self.state.value}; one call at a time")
        group_size = self.cfg.group_size if group_size is None else group_size
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        sampling = sampling or self.default_sampling
        refill = self.cfg.dynamic_sampling and more_prompts is not None
        if refill and scorer is None:
            raise ValueError("rollout.dynamic_sampling needs scorer= with more_prompts= (zero-signal groups are "
                             "found by their rewards)")
        self.state = ManagerState.RUNNING
        if self.agents is not None:
            self.agents.first_error = None
        self._idle = asyncio.Event()
        self._calls += 1
        stats = self.last_stats = RolloutStats()
        start = time.monotonic()
        try:
            batch = self._carry + self._new_groups(prompts, group_size, sampling)
            self._carry = []
            rounds = self.cfg.max_sampling_rounds if max_rounds is None else max(1, max_rounds)
            return await self._sample_rounds(batch, group_size, sampling, scorer, more_prompts if refill else None,
                                             stats, len(batch) if target is None else target, rounds)
        finally:
            stats.wall_s = time.monotonic() - start
            stats.carried_groups = len(self._carry)
            self.state = ManagerState.IDLE
            self._idle.set()

    async def abort(self, timeout_s: float = 60.0) -> None:
        """Stop the running `generate_groups` call (e.g. for a weight update) and wait until it returns.

        In-flight requests are aborted on the engines; their partial tokens are kept and the slots
        resume in the next call. A no-op when no call runs. Raises `RolloutError` if the call has
        not returned within `timeout_s`.
        """
        if self.state is ManagerState.IDLE or self._idle is None:
            return
        self.state = ManagerState.ABORTING
        self.last_stats.aborted = True
        # Slots still waiting for an engine hold no request: stop them right away. Agents are stopped too (their
        # slots run again from the start in the next call).
        for task, slot in list(self._tasks.items()):
            if not slot.in_request or self.agents is not None:
                task.cancel()
        deadline = time.monotonic() + timeout_s
        while not self._idle.is_set():
            busy = [r.engine for r in self.fleet.records if r.inflight > 0]
            await asyncio.gather(*(self._abort_engine(e) for e in busy))
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutError(f"rollout did not stop within {timeout_s:.1f}s of abort()")
            # Re-send the abort while waiting: a request may reach its engine after the first one.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), min(1.0, left))

    async def _abort_engine(self, engine: object) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(engine.abort(None), self.ft.health_timeout_s)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- sampling rounds

    def _new_groups(self, prompts: Sequence[PromptLike], group_size: int, sampling: SamplingParams
                    ) -> list[PendingGroup]:
        if self.environment is not None:
            # A tool call ends the model's turn, whatever sampling the caller chose (evaluation too).
            sampling = replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *self.environment.stop))))
        groups = []
        for item in prompts:
            spec = as_prompt_spec(item)
            slots = [Slot(j, slot_seed(sampling.seed, spec.prompt_index, j)) for j in range(group_size)]
            groups.append(PendingGroup(spec, sampling, slots))
        return groups

    async def _sample_rounds(
        self, batch: list[PendingGroup], group_size: int, sampling: SamplingParams,
        scorer: Scorer | None, more_prompts: PromptSource | None, stats: RolloutStats, target: int, max_rounds: int,
    ) -> list[Group]:
        kept: list[Group] = []
        seen = 0
        while True:
            stats.sampling_rounds += 1
            await self._run_slots(batch, stats)
            self._check_agents(stats)
            done = [g for g in batch if g.complete]
            self._carry.extend(g for g in batch if not g.complete)
            groups = [self._to_group(g) for g in done]
            if scorer is not None and groups:
                # Reward functions block (and may call services): in a worker thread, never on this loop.
                await asyncio.to_thread(scorer, groups)
            seen += len(groups)
            if more_prompts is not None:
                signal = [g for g in groups if self._keep(g)]
                stats.dropped_groups += len(groups) - len(signal)
                kept.extend(signal)
            else:
                kept.extend(groups)
            if (more_prompts is None or self.state is ManagerState.ABORTING or len(kept) >= target
                    or stats.sampling_rounds >= max_rounds):
                break
            # Over-sample by the observed keep rate (at least 1/4) so one more round likely fills the batch.
            keep_rate = max(len(kept) / seen if seen else 1.0, 0.25)
            wanted = math.ceil((target - len(kept)) / keep_rate)
            batch = self._new_groups(more_prompts(wanted), group_size, sampling)
            stats.refill_prompts += len(batch)
            if not batch:
                break
        return kept[:max(target, 0)] if more_prompts is not None else kept

    def _check_agents(self, stats: RolloutStats) -> None:
        """Every agent of the call failed: the agent plug-in is broken, and the run ends naming its first error."""
        if (self.agents is not None and stats.agents_started and not stats.agents_succeeded
                and self.state is ManagerState.RUNNING):
            raise PluginFailed("rollout.agent", RuntimeError(f"all {stats.agents_started} agents of the rollout "
                                                             f"failed; the first: {self.agents.first_error}"))

    def _keep(self, group: Group) -> bool:
        """The group filter's verdict; a plug-in filter that raises fails the rollout as `PluginFailed`."""
        if not self._filter_is_plugin:
            return self.group_filter(group)
        try:
            return bool(self.group_filter(group))
        except Exception as exc:
            raise PluginFailed("rollout.group_filter", exc) from exc

    async def _run_slots(self, groups: list[PendingGroup], stats: RolloutStats) -> None:
        tasks = {}
        for group in groups:
            for slot in group.slots:
                if not slot.done:
                    task = asyncio.ensure_future(self._fill_slot(group, slot, stats))
                    tasks[task] = slot
        self._tasks = tasks
        try:
            if not tasks:
                return
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                raise failed[0].exception()  # type: ignore[misc]
        finally:
            self._tasks = {}

    # -------------------------------------------------------------------- one slot

    async def _fill_slot(self, group: PendingGroup, slot: Slot, stats: RolloutStats) -> None:
        if self.agents is not None:
            await self.agents.fill(group, slot, stats)
            return
        if self.generate_fn is not None:
            await self._fill_slot_with_plugin(group, slot, stats)
            return
        spec = group.spec
        while not slot.done and self.state is ManagerState.RUNNING:
            remaining = group.sampling.max_new_tokens - len(slot.response_ids)
            if remaining <= 0:  # a resumed partial that already used its whole budget
                slot.finish_reason, slot.done = "length", True
                return
            if slot.finish_reason == "abort":
                stats.resumed_partials += 1
            lease = await self.fleet.acquire(frozenset(slot.failed_on), timeout_s=self.cfg.request_timeout_s)
            slot.in_request = True
            try:
                if self.state is not ManagerState.RUNNING:
                    await self.fleet.release(lease, ok=False)
                    return
                await self._request(spec, group.sampling, slot, lease, remaining, stats)
            finally:
                slot.in_request = False

    async def _request(self, spec: PromptSpec, sampling: SamplingParams, slot: Slot, lease: EngineLease,
                       remaining: int, stats: RolloutStats) -> None:
        """One request for `slot` on `lease`'s engine; updates the slot, the fleet and the stats."""
        params = replace(sampling, max_new_tokens=remaining, seed=slot.seed)
        # The counter keeps ids unique even when one prompt appears twice in a call.
        rid = f"r{self._calls}-p{spec.prompt_index}-s{slot.sample_index}-{next(self._request_ids)}"
        started = time.monotonic()
        try:
            # A timeout scope, not `wait_for`: on Python 3.11 `wait_for` wraps the request in a task of its own (a
            # task, a future and a timer more per request, and two more loop turns before the answer is read).
            async with asyncio.timeout(self.cfg.request_timeout_s):
                gen = await lease.engine.generate(
                    list(spec.prompt_ids) + slot.response_ids, params, rid=rid,
                    **({"return_routed_experts": True} if self.routing is not None else {}))
            if len(gen.output_ids) != len(gen.output_logprobs):
                raise ValueError(f"{len(gen.output_ids)} output ids but {len(gen.output_logprobs)} logprobs")
            if gen.finish_reason == "abort" and not gen.output_ids and self.state is ManagerState.RUNNING:
                raise RuntimeError("request aborted by the engine before producing any token")
        except asyncio.CancelledError:
            await asyncio.shield(self.fleet.release(lease, ok=False))
            raise
        except Exception as exc:  # connection refused/reset, HTTP error, timeout, malformed answer
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if _BAD_REQUEST.search(str(exc)):
                # The engine refused the request itself (4xx): every engine would; blame none, stop now.
                await self.fleet.release(lease, ok=False)
                raise RolloutError(f"prompt {spec.prompt_index} was rejected by {lease.engine_id} ({error}); "
                                   "fix the request (prompt length, sampling params)") from exc
            await self.fleet.release(lease, ok=False, error=error)
            if isinstance(exc, TimeoutError):
                asyncio.ensure_future(self._abort_rid(lease, rid))
            self._record_failure(spec, slot, lease.engine_id, error, stats)
            return
        await self.fleet.release(lease, ok=True)
        stats.requests += 1
        stats.latencies_s.append(time.monotonic() - started)
        stats.tokens_generated += len(gen.output_ids)
        stats.engines_used[lease.engine_id] = stats.engines_used.get(lease.engine_id, 0) + 1
        if gen.output_ids or gen.finish_reason != "abort":
            # An abort that produced nothing leaves no trace (its version did not write any token).
            slot.append(gen if gen.engine_id else replace(gen, engine_id=lease.engine_id))
        if gen.finish_reason != "abort":
            env = self.environment
            # Without an environment a finished turn ends the sample (no coroutine per request for it).
            slot.done = env is None or not await self._environment_reply(env, spec, slot, sampling.max_new_tokens)

    async def _environment_reply(self, env: ToolEnvironment, spec: PromptSpec, slot: Slot, budget: int) -> bool:
        """After a finished model turn, append the environment's `env` reply; True if the model goes on."""
        slot.turns += 1  # a finished model turn, whether a tool call, the answer or the token budget ended it
        if slot.finish_reason != "stop" or slot.turns >= self.cfg.max_turns:
            return False
        assert self.decode is not None and self.encode is not None
        try:
            # The environment's code blocks (a tool, a sandbox): it runs in the plug-in pool with a time limit.
            if slot.env is None:
                slot.env = await self.plugins.acall("rollout.environment reset()", start_trajectory, (env, spec.record))
            reply = await self.plugins.acall("rollout.environment reply()", slot.env.reply,
                                             (self.decode(slot.response_ids[slot.turn_start:]), spec.question))
            if reply is not None and not isinstance(reply, str):
                raise TypeError(f"reply() returned {type(reply).__name__}, expected str or None")
        except Exception as exc:
            raise PluginFailed("rollout.environment", exc) from exc
        if reply is None:
            return False
        ids = self.encode(reply)
        if len(ids) >= budget - len(slot.response_ids):
            # No room for the reply and an answer after it: the trajectory ends at its token budget.
            slot.finish_reason = "length"
            return False
        slot.append_environment(ids)
        return True

    async def _fill_slot_with_plugin(self, group: PendingGroup, slot: Slot, stats: RolloutStats) -> None:
        """The generate plug-in produces the whole completion; interrupted, it starts over in the next call."""
        assert self.generate_fn is not None
        client = SlotClient(self, group.spec, slot, stats)
        try:
            result = await self.generate_fn(client, group.spec, replace(group.sampling, seed=slot.seed))
        except Interrupted:
            return
        except RolloutError:
            raise  # the engines failed the plug-in's requests past their retries: not the plug-in's fault
        except Exception as exc:
            raise PluginFailed("rollout.generate_fn", exc) from exc
        try:
            if not isinstance(result, GenerateResult):
                raise TypeError(f"returned {type(result).__name__}, expected a GenerateResult")
            result.check()
        except (TypeError, ValueError) as exc:
            raise PluginFailed("rollout.generate_fn", exc) from exc
        slot.response_ids = list(result.response_ids)
        slot.logprobs = [float(v) for v in result.logprobs]
        slot.loss_mask = [int(v) for v in result.loss_mask]
        slot.versions, slot.engines = client.versions, client.engines
        slot.finish_reason, slot.done = result.finish_reason, True

    def _record_failure(self, spec: PromptSpec, slot: Slot, engine_id: str, error: str, stats: RolloutStats) -> None:
        slot.failures += 1
        slot.failed_on.add(engine_id)
        logger.warning("prompt %d sample %d failed on %s (%d/%d): %s", spec.prompt_index, slot.sample_index,
                       engine_id, slot.failures, self.ft.request_retries, error)
        if slot.failures > self.ft.request_retries:
            raise RolloutError(
                f"prompt {spec.prompt_index} sample {slot.sample_index} failed {slot.failures} times "
                f"(fault_tolerance.request_retries={self.ft.request_retries}); last error on {engine_id}: {error}"
            )
        stats.retries += 1
        self.fleet.record_retry()

    async def _abort_rid(self, lease: EngineLease, rid: str) -> None:
        # Best effort: free the engine from a request nobody waits for any more.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(lease.engine.abort(rid), self.ft.health_timeout_s)

    def _routed(self, spec: PromptSpec, slot: Slot) -> Any:
        if self.routing is None or slot.routed is None or not slot.response_ids:
            return None
        prompt = slot.prompt_ids if slot.prompt_ids is not None else spec.prompt_ids
        try:
            return self.routing.sample_ids(slot.routed, len(prompt), len(slot.response_ids))
        except ValueError as exc:
            raise RolloutError(f"prompt {spec.prompt_index} sample {slot.sample_index}: {exc}") from exc

    def _to_group(self, pending: PendingGroup) -> Group:
        spec = pending.spec
        samples = []
        for slot in pending.slots:
            if slot.dropped:  # a failed agent: no sample (counted in the call's stats)
                continue
            samples.append(Sample(
                prompt_index=spec.prompt_index,
                prompt_ids=list(slot.prompt_ids if slot.prompt_ids is not None else spec.prompt_ids),
                response_ids=list(slot.response_ids),
                rollout_logprobs=list(slot.logprobs),
                response_text=self.decode(list(slot.response_ids)) if self.decode else "",
                finish_reason=slot.finish_reason,
                engine_id=joined(slot.engines),
                weight_version=joined(slot.versions),
                loss_mask=list(slot.loss_mask) if 0 in slot.loss_mask else None,
                turns=slot.turns if self.environment is not None or self.agents is not None else 1,
                routed_experts=self._routed(spec, slot),
                agent=slot.agent,
            ))
        return Group(prompt_index=spec.prompt_index, prompt_text=spec.prompt_text, question=spec.question,
                     answer=spec.answer, steps=spec.steps, samples=samples, record=spec.record)
