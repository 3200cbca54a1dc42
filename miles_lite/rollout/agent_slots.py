"""Agent slots: how a `RolloutManager` fills a sample with the agent plug-in (`rollout.agent`).

Each slot opens a session of the run's gateway pinned to the slot's sampling (temperature, top-p, top-k and a
seed per sample; the whole response, appended messages included, within `rollout.max_new_tokens`, at most
`rollout.max_turns` model turns), hands the agent its base URL and key, and when the agent returns takes the
session's ids, loss mask and log-probs as the sample (the same record a tool environment's trajectory is:
model tokens with their log-probs, everything else mask 0). A failed, timed-out or turn-less agent leaves no
sample: the slot is dropped (counted), never trained on half-built. When every agent of a call fails, the run
ends as a failed plug-in (the agent is broken, not unlucky). An abort (weight update) cancels the agents; their
slots run again from the start in the next call.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from miles_lite.rollout.agent import AgentFailed, AgentRunner, AgentTimedOut
from miles_lite.rollout.gateway.server import PINNED, Gateway
from miles_lite.rollout.slots import PendingGroup, RolloutStats, Slot
from miles_lite.types import SamplingParams

logger = logging.getLogger(__name__)


def sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """The run's sampling as keyword arguments of `chat.completions.create` (top-k through `extra_body`)."""
    out: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.top_k > 0:
        out["extra_body"] = {"top_k": sampling.top_k}
    return out


class AgentSlots:
    """The gateway and the agent runner of a manager; `fill` produces one slot's sample."""

    def __init__(self, gateway: Gateway, runner: AgentRunner, max_turns: int | None) -> None:
        self.gateway, self.runner, self.max_turns = gateway, runner, max_turns
        # The first failure of the current call, reported if every agent of the call fails.
        self.first_error: str | None = None

    async def fill(self, group: PendingGroup, slot: Slot, stats: RolloutStats) -> None:
        spec, gateway = group.spec, self.gateway
        sampling = replace(group.sampling, seed=slot.seed)
        session = gateway.open(sampling=sampling, pinned=PINNED, evaluation=sampling.temperature == 0,
                               prompt_index=spec.prompt_index, budget=sampling.max_new_tokens,
                               max_turns=self.max_turns, interruptible=True, stats=stats)
        stats.agents_started += 1
        result: dict[str, Any] | None = None
        try:
            result = await self.runner.run(gateway.base_url(session), gateway.session_key(session), spec.record,
                                           sampling_kwargs(sampling))
        except AgentTimedOut as exc:
            stats.agents_timed_out += 1
            self._note(spec.prompt_index, slot, str(exc))
        except AgentFailed as exc:
            stats.agents_failed += 1
            self._note(spec.prompt_index, slot, str(exc), exc.__cause__)
        finally:
            gateway.discard(session)
            stats.tito_mismatch += session.tito_mismatch
            stats.session_engine_moves += session.engine_moves
            stats.session_diverged += session.diverged
            stats.session_branches += session.branches
        if result is not None and session.turns == 0:
            stats.agents_failed += 1
            result = None
            self._note(spec.prompt_index, slot, "the agent returned without a chat completion request")
        if result is None:
            slot.dropped, slot.done = True, True
            return
        stats.agents_succeeded += 1
        stats.agent_turns += session.turns
        slot.prompt_ids = session.ids[:session.prompt_len]
        slot.response_ids = session.ids[session.prompt_len:]
        slot.logprobs, slot.loss_mask = list(session.logprobs), list(session.mask)
        slot.versions, slot.engines, slot.routed = list(session.versions), list(session.engines), session.routed
        slot.turns, slot.finish_reason, slot.agent, slot.done = session.turns, session.finish_reason, result, True

    def _note(self, prompt_index: int, slot: Slot, error: str, cause: BaseException | None = None) -> None:
        if self.first_error is None:
            self.first_error = error
            logger.warning("agent of prompt %d sample %d dropped: %s", prompt_index, slot.sample_index, error,
                           exc_info=cause)
        else:
            logger.info("agent of prompt %d sample %d dropped: %s", prompt_index, slot.sample_index, error)


async def start_agent_slots(manager: Any, rollout: Any, template: Any, encode: Any, decode: Any,
                            api_key: str | None, model_name: str) -> AgentSlots:
    """Start the gateway on the running loop and attach agent slots to `manager` (`rollout`: the RolloutConfig)."""
    from miles_lite.rollout.agent import load_agent
    from miles_lite.rollout.gateway.turns import TurnRunner

    abort = load_agent(rollout.agent_abort, "rollout.agent_abort") if rollout.agent_abort else None
    runner = AgentRunner(load_agent(rollout.agent), max_concurrent=rollout.max_concurrent_agents,
                         timeout_s=rollout.agent_timeout_s, abort=abort, abort_timeout_s=rollout.plugin_timeout_s)
    gateway = Gateway(TurnRunner(manager), template, encode, decode, api_key=api_key, host=rollout.gateway_host,
                      port=rollout.gateway_port, model_name=model_name, defaults=manager.default_sampling,
                      options=dict(rollout.chat_template_kwargs),
                      branch=rollout.session_divergence == "branch")
    await gateway.start()
    slots = AgentSlots(gateway, runner, rollout.max_turns)
    manager.agents = slots
    logger.info("agent sessions served at %s (chat template %s)", gateway.url, template.name)
    return slots


async def stop_agent_slots(slots: AgentSlots) -> None:
    """Stop the gateway (closing every session) and the agent threads."""
    await slots.gateway.stop()
    slots.runner.close()
