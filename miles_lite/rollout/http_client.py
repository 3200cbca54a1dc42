"""`HttpEngine`: the RolloutEngine protocol over SGLang 0.5.10's native HTTP API (aiohttp).

Endpoints and payloads are those of SGLang 0.5.10's `entrypoints/http_server.py` / `managers/io_struct.py`;
the reference engine serves the same subset. Error handling:

- a non-200 answer, a connection failure or a timeout raises EngineError (with the engine id, path, status
  and the start of the body);
- weight and version calls that answer {"success": false, "message": ...} raise EngineError even with
  status 200, so a silently failed update never passes for a good one.

`score()` sends `/generate` with `max_new_tokens=1`, greedy, `return_logprob` and
`logprob_start_len = prompt_len - 1`: SGLang's `input_token_logprobs` covers `input_ids[start:]` and its first
entry has no logprob (None), so entries 1.. are exactly the logprobs of `input_ids[prompt_len:]` (raw
log-softmax, no temperature). SGLang 0.5.10 also accepts `max_new_tokens=0` (a prefill-only path); one
decoded token keeps the request on the ordinary path every version serves.

Each entry's token id is checked against the id that was sent, with one exception SGLang makes on
purpose: from 0.5.10 through 0.5.23 it reports every input id >= vocab_size - 1 as 0 (a clip meant for
image placeholder hashes, `_process_input_token_logprobs`), so the model's last id comes back as 0. An
entry (logprob, 0) is taken for id vocab_size - 1 only when the client knows the model's `vocab_size`
and that id is the one sent at that position; its logprob is still required and returned like any other.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np

from miles_lite.net.api_key import authorization
from miles_lite.rollout.engine import MEMORY_TAGS, EngineError
from miles_lite.rollout.generate_batch import GenerateBatch
from miles_lite.types import Generation, SamplingParams

_FINISH_TYPES = ("stop", "length", "abort")


# Seconds an idle keep-alive connection is kept: below the servers' own idle timeout (SGLang: 5 s).
CLIENT_KEEPALIVE_S = 3.0
# SGLang's refusal (HTTP 400) of a request whose id it is serving already.
DUPLICATE_RID = "Duplicate request ID"


def reported_input_id(token_id: int, vocab_size: int | None) -> int:
    """The id SGLang reports in `input_token_logprobs` for input id `token_id` (see the module docstring)."""
    return 0 if vocab_size is not None and token_id == vocab_size - 1 else token_id


class HttpEngine:
    """An engine reached over HTTP at `url` (an SGLang server or the reference engine).

    `vocab_size`: the served model's vocabulary size (config.json's `vocab_size`); with it, `score` accepts
    SGLang's relabelling of the last id as 0, and only that. Without it every id must come back as sent.
    """

    def __init__(self, engine_id: str, url: str, request_timeout_s: float = 600.0,
                 control_timeout_s: float = 60.0, vocab_size: int | None = None,
                 api_key: str | None = None, batch_generate: bool = False) -> None:
        """`api_key`: the run's key, sent with every request (`Authorization: Bearer`). `batch_generate`: the
        `generate` calls started in one turn of the event loop go out as one batched request (`generate_batch`)."""
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (the model's config.json vocab_size), got {vocab_size}")
        self.vocab_size = vocab_size
        self.engine_id = engine_id
        self._headers = authorization(api_key)
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        # Memory tags this client released on the engine: SGLang itself would take a request while its
        # KV cache is released (and fail it badly), so generation is refused here first.
        self.released: set[str] = set()
        # Generate/score requests of this client awaiting their answer (a release waits for none).
        self.inflight = 0
        # Tags being released now: generation and health probes are refused from the moment a release starts.
        self._releasing: set[str] = set()
        # `/health_generate` probes awaiting their answer: each runs a one-token generation on the engine.
        self._probing: set[asyncio.Future] = set()

        # The LoRA adapter every generate/score request names (SGLang's per-request `lora_path`); None: the base.
        self.lora_name: str | None = None
        self._batch = GenerateBatch(self._post_generate) if batch_generate else None

    def __repr__(self) -> str:
        return f"HttpEngine({self.engine_id!r}, {self.url!r})"

    # ---- transport -------------------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        # A session belongs to the loop that made it; callers that run several loops get one each.
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # No total-connection cap: the rollout manager bounds concurrency itself. Idle connections are
            # dropped before the server drops them (SGLang's uvicorn: 5 s): reusing one the server has just
            # closed fails with ServerDisconnectedError, which an H200 run hit after 5 s of training.
            self._session = aiohttp.ClientSession(headers=self._headers, connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S))
            self._session_loop = loop
        return self._session

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float,
                       expect_json: bool = True) -> Any:
        try:
            try:
                text = await self._send(self._get_session(), method, path, payload, timeout_s)
            except aiohttp.ServerDisconnectedError:
                # A pooled connection the server closed while this request went out on it (seen on one H100
                # with 256 requests at once, the keep-alive limit notwithstanding): the server never took the
                # request, so it goes once more, on a new connection of its own (the pool may hold more the
                # server has closed). A server that is gone fails the second try too; one that had taken it
                # refuses the second try's request id.
                async with aiohttp.ClientSession(headers=self._headers,
                                                 connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                    try:
                        text = await self._send(fresh, method, path, payload, timeout_s)
                    except EngineError as exc:
                        if DUPLICATE_RID not in str(exc):
                            raise
                        # The server had taken the first try after all (it dropped the connection mid-request:
                        # a stalled or dying server): the engine's fault, not the request's (no HTTP 400 to blame).
                        raise EngineError(f"{self.engine_id} {path}: ServerDisconnectedError: the server dropped "
                                          "the connection of a request it had taken (its second try was refused "
                                          "as a duplicate)") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"{self.engine_id} {path}: {type(exc).__name__}: {exc}") from exc
        if not expect_json:
            return text
        try:
            return json.loads(text)
        except ValueError as exc:
            raise EngineError(f"{self.engine_id} {path}: answer is not JSON: {text[:200]!r}") from exc

    async def _send(self, session: aiohttp.ClientSession, method: str, path: str, payload: dict[str, Any] | None,
                    timeout_s: float) -> str:
        """One request through `session`; the answer's body (EngineError on a status other than 200)."""
        async with session.request(method, f"{self.url}{path}", json=payload,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise EngineError(f"{self.engine_id} {path}: HTTP {resp.status}: {text[:500]}")
            return text

    async def _post_checked(self, path: str, payload: dict[str, Any], timeout_s: float | None = None) -> dict:
        """POST a weight/control call; SGLang answers {"success": bool, "message": str}."""
        data = await self._request("POST", path, payload, timeout_s or self.control_timeout_s)
        if not isinstance(data, dict) or data.get("success") is not True:
            message = (data.get("message") or data.get("error_message")) if isinstance(data, dict) else data
            raise EngineError(f"{self.engine_id} {path} failed: {message}")
        return data

    # ---- generation ------------------------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
                       return_routed_experts: bool = False) -> Generation:
        """Sample one completion: token ids in, token ids + per-token logprobs (nats) + finish reason out
        (with `return_routed_experts`, also SGLang's routed expert ids of every position run)."""
        payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling.to_sglang(),
                                   "return_logprob": True}
        if return_routed_experts:
            payload["return_routed_experts"] = True
        if rid is not None:
            payload["rid"] = rid
        self._refuse_while_released("/generate")
        if self.lora_name is not None:
            payload["lora_path"] = self.lora_name
        start = time.monotonic()
        data = await self._counted("/generate", payload)
        return self._parse_generation(data, time.monotonic() - start)

    async def _post_generate(self, body: dict[str, Any]) -> Any:
        return await self._request("POST", "/generate", body, self.request_timeout_s)

    async def _counted(self, path: str, payload: dict[str, Any]) -> Any:
        self.inflight += 1
        try:
            if path == "/generate" and self._batch is not None:
                return await self._batch.submit(payload)
            return await self._request("POST", path, payload, self.request_timeout_s)
        finally:
            self.inflight -= 1

    def _refuse_while_released(self, path: str) -> None:
        gone = self.released | self._releasing
        if gone:
            raise EngineError(f"{self.engine_id} {path}: refused, the engine's memory is released "
                              f"({', '.join(t for t in MEMORY_TAGS if t in gone)}); resume_memory first")

    def _refuse_while_weights_released(self, path: str) -> None:
        # SGLang would read or write the unmapped weights (and stop); a push resumes `weights` first.
        if "weights" in self.released or "weights" in self._releasing:
            raise EngineError(f"{self.engine_id} {path}: refused, the engine's weights are released; "
                              "resume_memory(['weights']) first")

    def _parse_generation(self, data: Any, latency_s: float) -> Generation:
        try:
            output_ids = [int(t) for t in data["output_ids"]]
            meta = data["meta_info"]
            entries = meta.get("output_token_logprobs") or []
            finish = meta["finish_reason"]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.engine_id} /generate: unexpected answer {str(data)[:300]}") from exc
        reason = finish.get("type") if isinstance(finish, dict) else finish
        if reason not in _FINISH_TYPES:
            raise EngineError(f"{self.engine_id} /generate: unknown finish_reason {finish!r}")
        if len(entries) != len(output_ids):
            raise EngineError(f"{self.engine_id} /generate: {len(output_ids)} output ids but {len(entries)} "
                              "output_token_logprobs")
        logprobs: list[float] = []
        for (lp, tok, *_), expected in zip(entries, output_ids, strict=True):
            if int(tok) != expected or lp is None:
                raise EngineError(f"{self.engine_id} /generate: logprob entry {[lp, tok]} does not match token "
                                  f"{expected}")
            logprobs.append(float(lp))
        routed = None
        if meta.get("routed_experts") is not None:
            try:
                routed = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
            except (TypeError, ValueError) as exc:
                raise EngineError(f"{self.engine_id} /generate: routed_experts is not base64 int32 ids") from exc
        return Generation(output_ids=tuple(output_ids), output_logprobs=tuple(logprobs), finish_reason=reason,
                          weight_version=str(meta.get("weight_version", "")), engine_id=self.engine_id,
                          latency_s=latency_s, routed_experts=routed)

    async def score(self, input_ids: list[int], prompt_len: int) -> list[float]:
        """Logprobs (nats) of `input_ids[prompt_len:]` given their prefixes (see the module docstring)."""
        if not 1 <= prompt_len < len(input_ids):
            raise ValueError(f"prompt_len must be in [1, len(input_ids)={len(input_ids)}), got {prompt_len}")
        payload = {"input_ids": list(input_ids), "return_logprob": True, "logprob_start_len": prompt_len - 1,
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        self._refuse_while_released("score")
        if self.lora_name is not None:
            payload["lora_path"] = self.lora_name
        data = await self._counted("/generate", payload)
        try:
            entries = data["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError) as exc:
            raise EngineError(f"{self.engine_id} score: no input_token_logprobs in {str(data)[:300]}") from exc
        targets = input_ids[prompt_len:]
        if len(entries) != len(targets) + 1:
            raise EngineError(f"{self.engine_id} score: {len(entries)} input logprobs for {len(targets)} + 1 tokens")
        out: list[float] = []
        for (lp, tok, *_), expected in zip(entries[1:], targets, strict=True):
            if lp is None or int(tok) not in (expected, reported_input_id(expected, self.vocab_size)):
                hint = ""
                if int(tok) == 0 and self.vocab_size is None:
                    hint = " (SGLang reports the model's last id as 0: give the client the model's vocab_size)"
                raise EngineError(f"{self.engine_id} score: entry {[lp, tok]} does not match token {expected}{hint}")
            out.append(float(lp))
        return out

    # ---- health and control ----------------------------------------------------------------------------------

    async def health(self, timeout_s: float) -> bool:
        """True if `/health_generate` answers 200 within `timeout_s` (False at once while memory is released
        or being released: the probe is a generation)."""
        if self.released or self._releasing:
            return False
        # Shielded: a caller giving up does not take the probe back from the engine, so a release still waits
        # for its answer (SGLang answers a second after it ran the probe's generation).
        probe = asyncio.ensure_future(self._request("GET", "/health_generate", None, timeout_s, expect_json=False))
        self._probing.add(probe)
        probe.add_done_callback(_probe_done(self._probing))
        try:
            await asyncio.shield(probe)
        except EngineError:
            return False
        return True

    async def weight_version(self) -> str:
        """`/model_info`'s weight_version (SGLang 0.5.10 answers 404 on `/get_weight_version`)."""
        data = await self._request("GET", "/model_info", None, self.control_timeout_s)
        if not isinstance(data, dict) or "weight_version" not in data:
            raise EngineError(f"{self.engine_id} /model_info has no weight_version: {str(data)[:200]}")
        return str(data["weight_version"])

    async def model_info(self) -> dict[str, Any]:
        """The `/model_info` object (model path, weight_version, architectures...)."""
        return await self._request("GET", "/model_info", None, self.control_timeout_s)

    async def server_info(self) -> dict[str, Any]:
        """`/get_server_info` (server arguments and internal states)."""
        return await self._request("GET", "/get_server_info", None, self.control_timeout_s)

    async def load(self) -> list[dict[str, Any]]:
        """`/get_load`: one entry per data-parallel rank (num_reqs, num_waiting_reqs, num_tokens)."""
        return await self._request("GET", "/get_load", None, self.control_timeout_s)

    async def pause(self, mode: str = "retract") -> None:
        """`/pause_generation`. `retract` (default here) keeps requests and recomputes their KV cache on resume;
        `in_place` keeps the KV cache; `abort` (SGLang's own default) aborts them."""
        await self._request("POST", "/pause_generation", {"mode": mode}, self.control_timeout_s)

    async def resume(self) -> None:
        """`/continue_generation`."""
        await self._request("POST", "/continue_generation", {}, self.control_timeout_s)

    async def flush_cache(self) -> None:
        """`/flush_cache` (SGLang answers 400 while requests are running)."""
        await self._request("POST", "/flush_cache", None, self.control_timeout_s, expect_json=False)

    async def abort(self, rid: str | None = None) -> None:
        """`/abort_request` for one rid, or `abort_all` when rid is None."""
        payload = {"abort_all": True} if rid is None else {"rid": rid}
        await self._request("POST", "/abort_request", payload, self.control_timeout_s, expect_json=False)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """`/update_weight_version` (SGLang aborts running requests unless told otherwise)."""
        await self._post_checked("/update_weight_version", {"new_version": new_version,
                                                            "abort_all_requests": abort_all_requests})

    # ---- memory (sleep / wake)
    #
    # SGLang (as of 0.5.23) serves these only when started with `--enable-memory-saver`; its scheduler
    # (`SchedulerWeightUpdaterManager.release_memory_occupation` / `resume_memory_occupation`) handles each tag
    # (`kv_cache`, `weights`, `cuda_graph`) through torch_memory_saver and checks almost nothing: a release
    # while a request runs fails an assertion, a resume of a tag not released fails `offload_tags.remove`, and
    # torch_memory_saver refuses to pause memory already paused or resume memory not paused. Any of these
    # stops the scheduler and with it the server. So the client refuses them itself, before sending: it
    # releases only tags it holds, with no request of its own in flight, and resumes only tags it released.
    # Nothing on SGLang's side refuses a generation or a weight load into released memory either (they would
    # touch unmapped device memory): generation is refused here until every tag is resumed, and a push
    # resumes `weights` first. A health probe (`/health_generate`) is a one-token generation too: a release
    # waits for the probes in flight, and probes answer False, unsent, from its start. Weights come back with
    # their values only with `--enable-weights-cpu-backup`; otherwise a push must load them before the engine
    # generates (`FleetPusher`).

    async def release_memory(self, tags: Sequence[str]) -> None:
        """`/release_memory_occupation` of `tags` (SGLang started with `--enable-memory-saver`).

        From the start generation is refused and health probes answer False at once; the health probes
        already sent are waited for first (each is a generation on the engine)."""
        tags = _memory_tags(tags)
        again = [t for t in tags if t in self.released or t in self._releasing]
        if again:
            raise EngineError(f"{self.engine_id} /release_memory_occupation: {again} already released; "
                              "resume_memory them first")
        if self.inflight:
            raise EngineError(f"{self.engine_id} /release_memory_occupation: {self.inflight} request(s) in flight; "
                              "SGLang releases memory only while idle (finish or abort them first)")
        self._releasing |= set(tags)
        try:
            loop = asyncio.get_running_loop()
            probes = [p for p in self._probing if p.get_loop() is loop]
            if probes:
                await asyncio.wait(probes)
            await self._memory_call("/release_memory_occupation", tags)
            self.released |= set(tags)
        finally:
            self._releasing -= set(tags)

    async def resume_memory(self, tags: Sequence[str]) -> None:
        """`/resume_memory_occupation` of `tags` (each released by this client before)."""
        tags = _memory_tags(tags)
        held = [t for t in tags if t not in self.released]
        if held:
            raise EngineError(f"{self.engine_id} /resume_memory_occupation: {held} not released by this client; "
                              "resume only released tags")
        await self._memory_call("/resume_memory_occupation", tags)
        self.released -= set(tags)

    async def _memory_call(self, path: str, tags: list[str]) -> None:
        # SGLang answers 200 with no body; a refusal is a non-200 answer.
        await self._request("POST", path, {"tags": tags}, self.request_timeout_s, expect_json=False)

    # ---- weights ---------------------------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Load HF safetensors from `model_path` (`/update_weights_from_disk`)."""
        self._refuse_while_weights_released("/update_weights_from_disk")
        await self._post_checked("/update_weights_from_disk", {"model_path": model_path,
                                                               "weight_version": weight_version},
                                 self.request_timeout_s)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str,
    ) -> None:
        """Join a torch.distributed group with the trainer at rank 0 (`/init_weights_update_group`).

        Returns when the engine has joined, so the trainer must join concurrently (this call blocks until then).
        """
        await self._post_checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }, self.request_timeout_s)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str, flush_cache: bool = True, load_format: str | None = None,
    ) -> None:
        """Receive the named tensors from rank 0 (`/update_weights_from_distributed`).

        `load_format` None: one broadcast per full HF tensor (SGLang's own path).
        """
        body: dict[str, Any] = {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version, "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        self._refuse_while_weights_released("/update_weights_from_distributed")
        await self._post_checked("/update_weights_from_distributed", body, self.request_timeout_s)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the weight-update group (`/destroy_weights_update_group`)."""
        await self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], load_format: str | None, weight_version: str | None,
        flush_cache: bool = True,
    ) -> None:
        """`/update_weights_from_tensor`: one serialized payload per engine TP rank.

        SGLang takes `MultiprocessingSerializer.serialize(named_tensors, output_str=True)` strings; the reference
        engine takes `engines.reference.model.serialize_named_tensors` strings.
        """
        self._refuse_while_weights_released("/update_weights_from_tensor")
        await self._post_checked("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "weight_version": weight_version, "flush_cache": flush_cache,
        }, self.request_timeout_s)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """`/load_lora_adapter`: load the PEFT directory `lora_path` as adapter `lora_name` (engines started with
        `--enable-lora`); returns the answer (`loaded_adapters`: every adapter the engine holds)."""
        return await self._post_checked("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path},
                                        self.request_timeout_s)

    async def load_lora_adapter_from_tensors(self, lora_name: str, config: dict[str, Any],
                                             payloads: list[str]) -> dict[str, Any]:
        """`/load_lora_adapter_from_tensors`: load adapter `lora_name` from the request itself (`config`: its
        `adapter_config.json`; `payloads`: one `formats.lora.adapter_payload` per engine TP rank)."""
        return await self._post_checked("/load_lora_adapter_from_tensors", {
            "lora_name": lora_name, "config_dict": config, "serialized_named_tensors": payloads,
        }, self.request_timeout_s)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """`/unload_lora_adapter`: drop adapter `lora_name`."""
        return await self._post_checked("/unload_lora_adapter", {"lora_name": lora_name})

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first `truncate_size` rows of a parameter (`/get_weights_by_name`)."""
        self._refuse_while_weights_released("/get_weights_by_name")
        return await self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                                   self.control_timeout_s)

    async def close(self) -> None:
        """Release the client's connections (does not stop the server)."""
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        self._session_loop = None


def _probe_done(probing: set[asyncio.Future]) -> Any:
    """Done callback of a health probe: forget it, and take its outcome (nobody may be waiting for it)."""

    def done(probe: asyncio.Future) -> None:
        probing.discard(probe)
        if not probe.cancelled():
            probe.exception()

    return done


def _memory_tags(tags: Sequence[str]) -> list[str]:
    """`tags` without repeats, in `MEMORY_TAGS` order; ValueError unless a non-empty subset of `MEMORY_TAGS`
    (SGLang reads an empty list as every tag and ignores unknown ones)."""
    given = list(tags)
    unknown = [t for t in given if t not in MEMORY_TAGS]
    if not given or unknown:
        raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, got {given}")
    return [t for t in MEMORY_TAGS if t in given]
