"""One agent session: the conversation a client drives through the gateway, held as the token ids the engines
saw and produced.

A session holds the history it rendered (the request's messages plus each model turn as it was read back),
the ids of that history (the first request's rendering, then per turn the model's output ids and the
tokens of whatever the next request appended), and per response token its log-prob (model tokens) or
mask 0 (everything the session appended). A new request must repeat the history: its longest stored prefix
is found at a turn boundary, the stored ids of that prefix are reused and only the appended messages are
rendered and tokenised (`formats/chat/incremental.py`). Whether the reused ids still equal a fresh
tokenisation of the whole rendered conversation is checked each turn: they may not (a model that wrote a
token sequence the tokenizer would not produce, a tool call written with other spacing), and then the stored
ids stay as they are and the turn is counted in `tito_mismatch`.

A request that does not repeat the history is refused (`SessionDiverged`, HTTP 400), or with
`rollout.session_divergence=branch` continues from the longest matching turn boundary: the turns after it
are dropped from the session (counted in `branches`) and never trained on.

Lifecycle: open -> closed (`close`: the client's DELETE, the agent returned, timed out or was stopped);
a closed session answers no more turns.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_lite.formats.chat import ChatTemplate, Message
from miles_lite.formats.chat.incremental import continuation
from miles_lite.formats.chat.messages import difference
from miles_lite.rollout.slots import joined
from miles_lite.types import Generation, SamplingParams


class SessionState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class SessionDiverged(ValueError):
    """A request whose history is not the session's; the message names the first message that differs."""


class SessionError(ValueError):
    """A request the session cannot run (closed, a template error); the message says why."""


@dataclass(frozen=True)
class Mark:
    """A turn boundary: the history's first `messages` messages are the first `ids` ids."""

    messages: int
    ids: int


@dataclass
class TurnPlan:
    """What a request adds before the model's turn: the ids to send, how many of the stored ids it keeps."""

    request: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] | None
    keep: Mark
    appended: list[int]
    input_ids: list[int]
    branched: bool
    mismatch: bool


@dataclass
class Session:
    """See the module docstring. `sampling`: the session's defaults; `pinned`: the sampling fields a request may
    not change (a training session's temperature, top-p and top-k: the trainer's importance weights assume
    the engine sampled with them)."""

    id: str
    template: ChatTemplate
    tokenize: Callable[[str], list[int]]
    sampling: SamplingParams
    pinned: frozenset[str] = frozenset()
    options: dict[str, Any] = field(default_factory=dict)
    evaluation: bool = False
    branch: bool = False
    # The prompt (and sample) an agent's session fills, for messages; -1 for a session a client opened.
    prompt_index: int = -1
    # An agent's session stops with its rollout (a weight update interrupts it); its turns count in `stats`.
    interruptible: bool = False
    stats: Any = None
    # The whole response (every turn and what the session appended) at most this many tokens; None: unbounded.
    budget: int | None = None
    max_turns: int | None = None
    state: SessionState = SessionState.OPEN
    history: list[Message] = field(default_factory=list)
    tools: tuple[Mapping[str, Any], ...] | None = None
    ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    routed: Any = None
    closed_turn: bool = True
    finish_reason: str = ""
    turns: int = 0
    # The engine serving the session's turns while it lives (its prefix cache holds the session's ids).
    engine: str | None = None
    tito_mismatch: int = 0
    branches: int = 0
    engine_moves: int = 0
    # Requests refused because their history diverged from the session's.
    diverged: int = 0
    # One turn at a time: a request arriving while one runs is refused (HTTP 409).
    busy: bool = False
    _stop_ids: frozenset[int] | None = None

    # ------------------------------------------------------------------------- requests

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len

    def _matching_mark(self, request: Sequence[Message], tools: Any) -> tuple[Mark, str | None]:
        """The latest turn boundary whose history `request` repeats, and why the next one does not match."""
        if self._tools_key(tools) != self._tools_key(self.tools) and self.marks:
            return Mark(0, 0), "the request's tools differ from the session's"
        best, why = Mark(0, 0), None
        for mark in self.marks:
            if len(request) <= mark.messages:
                why = why or (f"the request has {len(request)} messages, and the session holds {mark.messages} through "
                              "its turns: a request must add messages to the history")
                break
            problem = next(((i, d) for i in range(best.messages, mark.messages)
                            if (d := difference(self.history[i], request[i])) is not None), None)
            if problem is not None:
                i, d = problem
                why = f"messages[{i}] ({request[i].role}) differs from the session's history: {d}"
                break
            best = mark
        return best, why

    @staticmethod
    def _tools_key(tools: Any) -> Any:
        return tuple(repr(t) for t in tools) if tools else None

    def plan(self, request: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
             options: Mapping[str, Any]) -> TurnPlan:
        """The ids to send for `request`; raises SessionDiverged (see the module docstring) or SessionError."""
        if self.state is not SessionState.OPEN:
            raise SessionError(f"session {self.id} is closed")
        if request[-1].role == "assistant" and request[-1].tool_calls:
            raise SessionError(f"messages[{len(request) - 1}] is an assistant tool call: send its tool results first")
        tools = tuple(tools) if tools else None
        keep, why = self._matching_mark(request, tools)
        latest = self.marks[-1] if self.marks else Mark(0, 0)
        branched = keep != latest
        if branched and not self.branch:
            raise SessionDiverged(f"{why}; a session's requests must repeat its history (or set "
                                  "rollout.session_divergence=branch)")
        history = self.history[:keep.messages]
        closed = self.closed_turn if keep == latest else True
        text = continuation(self.template, history, list(request), tools, options, closed)
        appended = self.tokenize(text)
        input_ids = self.ids[:keep.ids] + appended
        mismatch = False
        if keep.ids:
            fresh = self.tokenize(self.template.render(list(request), tools, add_generation_prompt=True,
                                                       options=options))
            mismatch = fresh != input_ids
        return TurnPlan(tuple(request), tools, keep, appended, input_ids, branched, mismatch)

    def remaining_budget(self, plan: TurnPlan) -> int | None:
        """Tokens the model may still write after `plan`'s appended ids (None: unbounded)."""
        if self.budget is None:
            return None
        response_before = max(plan.keep.ids - self.prompt_len, 0) if plan.keep.ids else 0
        appended = len(plan.appended) if plan.keep.ids else 0
        return self.budget - response_before - appended

    def turns_left(self, plan: TurnPlan) -> bool:
        done = sum(1 for m in self.marks if m.ids <= plan.keep.ids) if plan.keep.ids else 0
        return self.max_turns is None or done < self.max_turns

    # ------------------------------------------------------------------------- results

    def commit(self, plan: TurnPlan, gen: Generation, reply: Message) -> None:
        """Record the model's turn `gen` (read back as `reply`) after `plan`'s appended ids."""
        if plan.branched:
            self.branches += 1
        if not plan.keep.ids:  # the first turn (or a branch back to the start): the request is the prompt
            self.ids, self.prompt_len, self.logprobs, self.mask = list(plan.appended), len(plan.appended), [], []
            self.marks, self.versions, self.engines, self.turns = [], [], [], 0
        else:
            cut = plan.keep.ids - self.prompt_len
            self.ids = self.ids[:plan.keep.ids] + plan.appended
            self.logprobs = self.logprobs[:cut] + [0.0] * len(plan.appended)
            self.mask = self.mask[:cut] + [0] * len(plan.appended)
            self.marks = [m for m in self.marks if m.ids <= plan.keep.ids]
            self.turns = len(self.marks)
        self.tito_mismatch += plan.mismatch
        self.ids += gen.output_ids
        self.logprobs += gen.output_logprobs
        self.mask += [1] * len(gen.output_ids)
        self.versions.append(gen.weight_version)
        self.engines.append(gen.engine_id)
        self.routed = gen.routed_experts
        self.history = [*plan.request, reply]
        self.tools = plan.tools
        self.turns += 1
        self.marks.append(Mark(len(self.history), len(self.ids)))
        self.closed_turn = bool(gen.output_ids) and gen.output_ids[-1] in self.stop_ids
        self.finish_reason = gen.finish_reason

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids of the template's end-of-turn tokens (each one token of the tokenizer)."""
        if self._stop_ids is None:
            self._stop_ids = frozenset(ids[0] for t in self.template.stop_texts if len(ids := self.tokenize(t)) == 1)
        return self._stop_ids

    def close(self) -> None:
        self.state = SessionState.CLOSED

    def record(self) -> dict[str, Any]:
        """The session as JSON: ids, mask and log-probs of the response, turns and where they ran."""
        return {"id": self.id, "state": self.state.value, "evaluation": self.evaluation, "turns": self.turns,
                "prompt_ids": self.ids[:self.prompt_len], "response_ids": self.ids[self.prompt_len:],
                "loss_mask": list(self.mask), "rollout_logprobs": list(self.logprobs),
                "weight_version": joined(self.versions), "engines": joined(self.engines), "engine": self.engine,
                "finish_reason": self.finish_reason, "tito_mismatch": self.tito_mismatch,
                "branches": self.branches, "engine_moves": self.engine_moves, "diverged": self.diverged}
