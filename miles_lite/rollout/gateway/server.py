"""The session gateway's HTTP server: OpenAI chat completions per session, in front of the engines.

Routes (every one but `/health` asks `Authorization: Bearer KEY`: the run's key, or for the paths of one
session that session's own key, which is all an agent is given):

- `POST /sessions` (run key): open a session; body (all optional) `{"sampling": {"temperature", "top_p",
  "top_k", "max_tokens", "stop", "seed"}, "evaluation": bool, "chat_template_kwargs": {...}}`; answers 201
  `{"id", "base_url", "api_key"}` (an evaluation session samples greedily unless `sampling` says otherwise);
- `POST /sessions/<id>/v1/chat/completions`: one model turn (OpenAI's request and answer, streaming with
  `"stream": true`); 400 naming the field for a bad request or a history that diverges from the session's,
  404 for an unknown session, 409 while another turn of the session runs, 503 when the run interrupted the
  session (a weight update), 502 when the engines failed the turn past their retries;
- `GET /sessions/<id>/v1/models`: the served model, as OpenAI lists models;
- `GET /sessions/<id>`: the session's record (token ids, loss mask, log-probs, turns, engine and its URL);
- `DELETE /sessions/<id>`: close the session; answers its record.

It runs on the rollout event loop beside the manager; each turn is one engine request through `TurnRunner`.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from miles_lite.formats.chat import ChatTemplate, Message, MessageError
from miles_lite.formats.chat.incremental import NotAppendOnly
from miles_lite.formats.chat.parsing import parse_turn
from miles_lite.net.api_key import bearer_matches, derive
from miles_lite.net.ports import LOCAL_HOST
from miles_lite.rollout.fleet import FleetExhausted
from miles_lite.rollout.gateway.openai_io import (
    Answer,
    ChatRequest,
    RequestError,
    error_json,
    finish_reason,
    parse_request,
    with_call_ids,
)
from miles_lite.rollout.gateway.session import Session, SessionDiverged, SessionError, SessionState
from miles_lite.rollout.gateway.turns import TurnRunner
from miles_lite.rollout.generate_plugin import Interrupted
from miles_lite.rollout.slots import RolloutError
from miles_lite.types import Generation, SamplingParams

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
# Sampling fields a training session pins (the trainer's importance weights assume them).
PINNED = frozenset({"temperature", "top_p", "top_k"})
_MAX_BODY = 64 << 20


class Gateway:
    """The run's session gateway; `start()` on the rollout loop, `stop()` at the end.

    `encode`/`decode` are the model's tokenizer (no special tokens added; special tokens kept in the decoded
    text); `api_key`: the run's key (None: open, for loopback tests); `defaults`: the sampling of sessions
    clients open; `options`: `rollout.chat_template_kwargs`."""

    def __init__(self, runner: TurnRunner, template: ChatTemplate, encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], *, api_key: str | None, host: str = LOCAL_HOST,
                 port: int = 0, model_name: str = "policy", defaults: SamplingParams | None = None,
                 options: dict[str, Any] | None = None, branch: bool = False) -> None:
        self.runner, self.template, self.encode, self.decode = runner, template, encode, decode
        self.api_key, self.host, self.port, self.model_name = api_key, host, port, model_name
        self.defaults = defaults or SamplingParams()
        self.options = dict(options or {})
        self.branch = branch
        self.sessions: dict[str, Session] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------------- lifecycle

    async def start(self) -> str:
        app = web.Application(client_max_size=_MAX_BODY, middlewares=[self._auth])
        app.add_routes([web.get("/health", self._health), web.post("/sessions", self._open),
                        web.get("/sessions/{sid}", self._get), web.delete("/sessions/{sid}", self._delete),
                        web.post("/sessions/{sid}/v1/chat/completions", self._chat),
                        web.get("/sessions/{sid}/v1/models", self._models)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{port}"
        return self.url

    async def stop(self) -> None:
        for session in self.sessions.values():
            session.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ------------------------------------------------------------------------- sessions

    def open(self, *, sampling: SamplingParams, pinned: frozenset[str] = frozenset(), evaluation: bool = False,
             options: dict[str, Any] | None = None, prompt_index: int = -1, budget: int | None = None,
             max_turns: int | None = None, interruptible: bool = False, stats: Any = None) -> Session:
        """A new open session, registered under a fresh id."""
        sid = secrets.token_hex(8)
        session = Session(sid, self.template, self.encode, sampling, pinned, {**self.options, **(options or {})},
                          evaluation=evaluation, branch=self.branch, budget=budget, max_turns=max_turns,
                          prompt_index=prompt_index, interruptible=interruptible, stats=stats)
        self.sessions[sid] = session
        return session

    def base_url(self, session: Session) -> str:
        """What an OpenAI client takes as `base_url` for `session`."""
        return f"{self.url}/sessions/{session.id}/v1"

    def session_key(self, session: Session) -> str:
        """The key of `session`'s paths alone (derived from the run's key; "" when the gateway asks none)."""
        return derive(self.api_key, f"session:{session.id}") if self.api_key else "no-key"

    def discard(self, session: Session) -> None:
        session.close()
        self.sessions.pop(session.id, None)

    # ------------------------------------------------------------------------- HTTP

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if self.api_key is None or request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        if bearer_matches(header, self.api_key):
            return await handler(request)
        sid = request.match_info.get("sid")
        session = self.sessions.get(sid) if sid else None
        if session is not None and bearer_matches(header, self.session_key(session)):
            return await handler(request)
        return web.json_response(error_json("a missing or wrong API key: send Authorization: Bearer KEY (the run's "
                                            "key, or the session's own for its paths)", "authentication_error"),
                                 status=401)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _session(self, request: web.Request) -> Session:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise web.HTTPNotFound(text=json.dumps(error_json(f"no session {request.match_info['sid']!r}: it was "
                                                              "never opened, or it was closed", "not_found_error")),
                                   content_type="application/json")
        return session

    async def _open(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
            sampling, options, evaluation = self._session_body(body)
        except (ValueError, RequestError) as exc:
            return web.json_response(error_json(str(exc)), status=400)
        session = self.open(sampling=sampling, evaluation=evaluation, options=options)
        return web.json_response({"id": session.id, "base_url": self.base_url(session),
                                  "api_key": self.session_key(session)}, status=201)

    def _session_body(self, body: Any) -> tuple[SamplingParams, dict[str, Any], bool]:
        if not isinstance(body, dict):
            raise RequestError("the body of POST /sessions must be a JSON object")
        evaluation = bool(body.get("evaluation", False))
        base = replace(self.defaults, temperature=0.0, top_p=1.0, top_k=-1) if evaluation else self.defaults
        raw = body.get("sampling") or {}
        if not isinstance(raw, dict):
            raise RequestError("sampling must be an object")
        req = parse_request({**raw, "messages": [{"role": "user", "content": "-"}]})
        sampling = self._resolve(base, frozenset(), req)
        options = body.get("chat_template_kwargs") or {}
        if not isinstance(options, dict):
            raise RequestError("chat_template_kwargs must be an object")
        return sampling, options, evaluation

    async def _get(self, request: web.Request) -> web.Response:
        session = self._session(request)
        return web.json_response({**session.record(), "engine_url": self._engine_url(session)})

    def _engine_url(self, session: Session) -> str | None:
        """The URL of the engine serving `session` (None before its first turn)."""
        if session.engine is None:
            return None
        try:
            return self.runner.manager.fleet.by_id(session.engine).engine.url
        except KeyError:
            return None

    async def _delete(self, request: web.Request) -> web.Response:
        session = self._session(request)
        record = session.record()
        self.discard(session)
        return web.json_response({**record, "state": SessionState.CLOSED.value})

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": 0, "owned_by": "miles-lite"}]})

    def _resolve(self, base: SamplingParams, pinned: frozenset[str], req: ChatRequest) -> SamplingParams:
        values: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(req, name)
            if value is None:
                continue
            if name in pinned and value != getattr(base, name):
                raise RequestError(f"{name}={value!r} differs from this session's {getattr(base, name)!r} "
                                   f"(rollout.{name}): a training session samples as the run does, which the "
                                   "trainer's importance weights assume; leave it out")
            values[name] = value
        if req.max_tokens is not None:
            values["max_new_tokens"] = req.max_tokens
        if req.seed is not None:
            values["seed"] = req.seed
        return replace(base, stop=tuple(dict.fromkeys((*base.stop, *req.stop))), **values)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        try:
            req = parse_request(await request.json())
        except (ValueError, RequestError) as exc:
            return web.json_response(error_json(str(exc)), status=400)
        if session.busy:
            return web.json_response(error_json(f"session {session.id} is running a turn; send one request at a "
                                                "time"), status=409)
        session.busy = True
        try:
            answer = await self._turn(session, req)
        except SessionDiverged as exc:
            session.diverged += 1
            return web.json_response(error_json(str(exc), param="messages"), status=400)
        except (RequestError, SessionError, NotAppendOnly, MessageError) as exc:
            return web.json_response(error_json(str(exc)), status=400)
        except Interrupted:
            return web.json_response(error_json("the run interrupted this session (a weight update); its agent is "
                                                "restarted", "server_error"), status=503)
        except (RolloutError, FleetExhausted) as exc:
            return web.json_response(error_json(f"the engines failed this turn: {exc}", "server_error"), status=502)
        finally:
            session.busy = False
        if not req.stream:
            return web.json_response(answer.completion())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in answer.events():
            await response.write(event.encode())
        await response.write_eof()
        return response

    async def _turn(self, session: Session, req: ChatRequest) -> Answer:
        options = {**session.options, **req.options}
        plan = session.plan(req.messages, req.tools, options)
        sampling = self._resolve(session.sampling, session.pinned, req)
        budget = session.remaining_budget(plan)
        if (budget is not None and budget <= 0) or not session.turns_left(plan):
            # The session's token budget (rollout.max_new_tokens) or turns (rollout.max_turns) are spent.
            return self._answer(session, req, plan.input_ids, Generation((), (), "length", ""), Message("assistant"))
        seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + session.turns) % (2**31 - 1)
        sampling = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget or sampling.max_new_tokens),
                           stop_token_ids=tuple(sorted(session.stop_ids)), seed=seed)
        gen = await self.runner.generate(session, plan.input_ids, sampling, interruptible=session.interruptible,
                                         stats=session.stats)
        reply = self._read_turn(session, gen, req)
        if session.state is SessionState.OPEN:
            session.commit(plan, gen, reply)
        return self._answer(session, req, plan.input_ids, gen, reply)

    def _read_turn(self, session: Session, gen: Generation, req: ChatRequest) -> Message:
        ids = list(gen.output_ids)
        if ids and ids[-1] in session.stop_ids:
            ids = ids[:-1]
        text = self.decode(ids)
        cuts = [text.find(s) for s in req.stop if s in text]
        if cuts:  # OpenAI leaves the stop sequence out of the content
            text = text[:min(cuts)]
        if req.parse_tools:
            return with_call_ids(self.template.parse(text))
        return parse_turn(text, "none", self.template.reasoning)

    def _answer(self, session: Session, req: ChatRequest, input_ids: Sequence[int], gen: Generation,
                reply: Message) -> Answer:
        texts = [self.decode([t]) for t in gen.output_ids] if req.logprobs else []
        info = {"id": session.id, "turn": session.turns, "engine": session.engine,
                "weight_version": gen.weight_version}
        return Answer(req, reply, finish_reason(gen.finish_reason, reply), len(input_ids), gen.output_ids, input_ids,
                      gen.output_logprobs, texts, info)
