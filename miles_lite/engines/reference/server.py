"""The reference engine's HTTP server: SGLang 0.5.10's native API subset over aiohttp.

Routes, payloads and answers follow SGLang's `entrypoints/http_server.py` and `managers/io_struct.py`:
failures of weight calls answer 400 with {"success": false, "message": ...}, bad requests (also a field of
the wrong type, or JSON nested too deeply) answer 400 with {"error": {"message": ...}} naming the field.
Bodies are bounded by what a request can need (413 beyond; `--max-request-bytes`, the weight payloads by the
model's size) and read with a deadline; connections idle for `--idle-timeout-s` are closed.
Test-only behaviour: `drop_weight_updates` acknowledges weight updates (and
bumps the version) but keeps the old weights; `fail_mode` hang/error stops answering or answers 500 to
`/generate` and `/health_generate` once `fail_after` generate requests have been served; `record_requests` logs them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from miles_lite.engines.reference import http_io
from miles_lite.engines.reference import request_fields as rf
from miles_lite.engines.reference.http_io import bad_request, json_error, json_result, read_body, split_batch
from miles_lite.engines.reference.lora_routes import LoraRoutes
from miles_lite.engines.reference.memory import EngineMemory, MemoryRequestError, requested_tags
from miles_lite.engines.reference.model import ReferenceModel, deserialize_named_tensors, read_safetensors
from miles_lite.engines.reference.ranks import EngineRanks
from miles_lite.engines.reference.sampling import RequestSampling
from miles_lite.engines.reference.scheduler import GenRequest, PauseMode, Scheduler
from miles_lite.engines.reference.shards import ShardedWeights
from miles_lite.net.api_key import bearer_matches

log = logging.getLogger("miles_lite.reference_engine")

FAIL_MODES = ("none", "hang", "error")
# Paths served without the API key: liveness for kubelet probes and load balancers. `/health` takes no input
# and answers only a status (200 once a one-token probe on a fixed prompt succeeds).
OPEN_PATHS = frozenset({"/health"})


@dataclass
class ServerOptions:
    """Everything the reference server is started with (see `engine.add_reference_arguments`)."""

    model_path: str
    dtype: str = "float32"
    max_batch_size: int = 64
    weight_version: str = "default"
    drop_weight_updates: bool = False
    fail_mode: str = "none"
    fail_after: int = 0
    record_requests: str | None = None  # test: a JSON-lines file of every /generate request and its answer
    return_original_logprob: bool = False
    group_timeout_s: float = 600.0
    # Tensor-parallel ranks: one per process in the weight-update group, one SGLang-laid-out store each.
    tp: int = 1
    # `module.function` paths a `/update_weights_from_tensor` load_format may name (SGLang's --custom-weight-loader).
    custom_weight_loader: tuple[str, ...] = ()
    # Every path but OPEN_PATHS asks `Authorization: Bearer <api_key>` (None: nothing is asked; kept out of reprs).
    api_key: str | None = field(default=None, repr=False)

    # SGLang's --enable-lora / --max-lora-rank: serve LoRA adapters loaded at run time.
    enable_lora: bool = False
    max_lora_rank: int | None = None
    # SGLang's --enable-weights-cpu-backup: released weights come back on resume (else they are lost).
    enable_weights_cpu_backup: bool = False
    # Largest request body (bytes) but weight payloads; 0: what a full batch of the model's context needs.
    max_request_bytes: int = 0
    # Seconds a connection may stay idle (no request, or a body that stops arriving) before it is closed.
    idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        if self.fail_mode not in FAIL_MODES:
            raise ValueError(f"--fail-mode {self.fail_mode!r} is not one of {FAIL_MODES}")
        if self.fail_after < 0:
            raise ValueError(f"--fail-after must be >= 0, got {self.fail_after}")
        if self.max_request_bytes < 0:
            raise ValueError(f"--max-request-bytes must be >= 0 (0: derived from the model), got "
                             f"{self.max_request_bytes}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"--idle-timeout-s must be > 0 seconds, got {self.idle_timeout_s}")


class ReferenceServer:
    """The aiohttp application around one `ReferenceModel` and its `Scheduler`."""

    def __init__(self, opts: ServerOptions) -> None:
        self.opts = opts
        self.model = ReferenceModel(opts.model_path, opts.dtype)
        self.tokenizer = _load_tokenizer(opts.model_path)
        self.weight_version = opts.weight_version
        self.scheduler = Scheduler(self.model, opts.max_batch_size, lambda: self.weight_version, self.tokenizer,
                                   opts.return_original_logprob)
        self.model.lora.max_rank = opts.max_lora_rank
        self.weights = ShardedWeights(self.model, opts.tp)
        # A rank's reply waits for the collective it is in, which gives up after the group timeout.
        self.ranks = EngineRanks(self.weights.specs, self.weights.engine, opts.group_timeout_s + 60.0,
                                 self.weights.stores)
        self.memory = EngineMemory()
        self._generate_count = 0
        self._hang = asyncio.Event()  # set only at shutdown: what a hung engine waits on
        self.request_limit = opts.max_request_bytes or rf.request_limit(self.model.max_positions,
                                                                         opts.max_batch_size)
        parameters = sum(p.numel() for p in self.model.model.parameters())
        self.weights_limit = max(self.request_limit, rf.weights_limit(parameters, opts.tp))
        self.app = web.Application(client_max_size=self.weights_limit, middlewares=[self._authenticate])
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)
        self.app.on_cleanup.append(self._on_cleanup)
        routes = [
            ("*", "/generate", self.generate), ("GET", "/health", self.health_generate),
            ("GET", "/health_generate", self.health_generate), ("GET", "/model_info", self.model_info),
            ("GET", "/get_model_info", self.model_info), ("GET", "/server_info", self.server_info),
            ("GET", "/get_server_info", self.server_info), ("GET", "/get_load", self.get_load),
            ("*", "/flush_cache", self.flush_cache), ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation), ("POST", "/abort_request", self.abort_request),
            ("POST", "/update_weight_version", self.update_weight_version),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/update_weights_from_tensor", self.update_weights_from_tensor),
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group),
            ("*", "/get_weights_by_name", self.get_weights_by_name),
            ("*", "/release_memory_occupation", self.release_memory_occupation),
            ("*", "/resume_memory_occupation", self.resume_memory_occupation),
            *LoraRoutes(self.model.lora, self.scheduler, opts.enable_lora, opts.tp, self._body).routes(),
        ]
        for method, path, handler in routes:
            self.app.router.add_route(method, path, handler)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """401 before the handler runs (no body read, no work) unless the request presents the key."""
        key = self.opts.api_key
        if key is not None and request.path not in OPEN_PATHS \
                and not bearer_matches(request.headers.get("Authorization"), key):
            return web.json_response({"error": {"message": "Unauthorized: send the run's API key as "
                                                           "'Authorization: Bearer <key>'"}},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def _body(self, request: web.Request, weights: bool = False) -> dict[str, Any]:
        """The JSON object a request carries (its query without a body); anything else answers 400."""
        if not request.can_read_body:
            return dict(request.query)
        if weights:
            limit, what = self.weights_limit, "this model's weights can need"
        else:
            limit, what = self.request_limit, "a request can need here (--max-request-bytes)"
        try:
            data = rf.parse_json(await read_body(request, limit, self.opts.idle_timeout_s, what))
        except rf.FieldError as exc:
            raise bad_request(str(exc)) from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        return data

    async def _on_startup(self, _app: web.Application) -> None:
        self.scheduler.start()

    async def _on_shutdown(self, _app: web.Application) -> None:
        # Let in-flight handlers answer before the server waits for them: hung ones and generations.
        self._hang.set()
        self.scheduler.abort(None, message="Server shutting down")

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.scheduler.close()
        self.ranks.close()

    # ---- generation ------------------------------------------------------------------------------------------

    async def _injected_failure(self) -> web.Response | None:
        if self.opts.fail_mode == "none" or self._generate_count <= self.opts.fail_after:
            return None
        if self.opts.fail_mode == "error":
            return json_error(f"injected failure after {self.opts.fail_after} generate requests", status=500)
        await self._hang.wait()  # hang: accept the connection, answer only when the server shuts down
        return json_error("server shutting down", status=503)

    async def generate(self, request: web.Request) -> web.Response:
        """SGLang `/generate` with token ids: a single request (input_ids: list[int]) or a batch (list of lists)."""
        try:
            body = await self._body(request)
            batch = split_batch(body)
            reqs = [self._make_request(item) for item in batch]
        except (ValueError, TypeError) as exc:
            return json_error(str(exc))
        refusal = self.memory.serving_refusal()
        if refusal is not None:
            return json_error(refusal, status=503)
        self._generate_count += 1
        failure = await self._injected_failure()
        if failure is not None:
            return failure
        try:
            outs = await asyncio.gather(*(self.scheduler.submit(r) for r in reqs))
        except ValueError as exc:
            return json_error(str(exc))
        except RuntimeError as exc:
            return json_error(str(exc), status=500)
        if self.opts.record_requests:
            http_io.record_requests(self.opts.record_requests, [(r.rid, r.input_ids) for r in reqs], outs)
        return web.json_response(outs if isinstance(body.get("input_ids", [None])[0], list) else outs[0])

    def _make_request(self, item: dict[str, Any]) -> GenRequest:
        if item.get("text") is not None or item.get("input_ids") is None:
            raise ValueError("the reference engine takes token ids: send input_ids (text is not supported)")
        input_ids = rf.token_ids(item["input_ids"], item.get("_field", "input_ids"))
        self.scheduler.validate_prompt(input_ids)
        sampling = RequestSampling.from_json(item.get("sampling_params"), self.model.vocab_size)
        if sampling.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop needs a tokenizer, and the model directory has none; "
                             "use stop_token_ids")
        start = rf.optional_integer(item.get("logprob_start_len"), "logprob_start_len")
        start = -1 if start is None else start
        if start >= len(input_ids):
            raise ValueError(f"logprob_start_len={start} must be < len(input_ids)={len(input_ids)}")
        routed = rf.boolean(item.get("return_routed_experts", False) or False, "return_routed_experts")
        if routed and self.model.routing is None:
            raise ValueError("return_routed_experts=true needs a mixture-of-experts model; this one is dense")
        adapter = None
        if item.get("lora_path") is not None:
            if not self.opts.enable_lora:
                raise ValueError("lora_path needs LoRA serving: start the engine with --enable-lora")
            adapter = self.model.lora.get(rf.string(item["lora_path"], "lora_path"))
        rid = item.get("rid")
        return GenRequest(rid=rf.string(rid, "rid") if rid is not None else uuid.uuid4().hex, input_ids=input_ids,
                          sampling=sampling, logprob_start_len=start,
                          return_logprob=rf.boolean(item.get("return_logprob", False) or False, "return_logprob"),
                          future=asyncio.get_running_loop().create_future(), return_routed_experts=routed,
                          adapter=adapter)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once a one-token greedy generation of [0] succeeds (runs even while paused)."""
        failure = await self._injected_failure()
        if failure is not None:
            return web.Response(status=503)
        refusal = self.memory.serving_refusal()
        if refusal is not None:
            return web.Response(text=refusal, status=503)
        probe = GenRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                           sampling=RequestSampling(max_new_tokens=1, temperature=0.0), return_logprob=False,
                           logprob_start_len=-1, future=asyncio.get_running_loop().create_future(), probe=True)
        try:
            await self.scheduler.submit(probe)
        except RuntimeError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.scheduler.abort(None if body.get("abort_all") else str(body.get("rid") or ""))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            mode = PauseMode(body.get("mode", "abort"))
        except ValueError:
            return json_error(f"Invalid mode: {body.get('mode')!r}. Expected one of {[m.value for m in PauseMode]}.")
        self.scheduler.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.scheduler.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ---- information -----------------------------------------------------------------------------------------

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.model.config
        return web.json_response({
            "model_path": self.opts.model_path, "tokenizer_path": self.opts.model_path if self.tokenizer else None,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
            "tp_size": self.opts.tp,
            "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.opts.model_path, "tp_size": self.opts.tp, "dp_size": 1,
            "weight_version": self.weight_version,
            "max_running_requests": self.opts.max_batch_size, "dtype": self.opts.dtype,
            "internal_states": [{"paused": self.scheduler.paused, "memory_released": sorted(self.memory.released),
                                 **self.scheduler.load()}],
            "version": "miles-lite-reference",
        })

    async def get_load(self, request: web.Request) -> web.Response:
        return web.json_response([self.scheduler.load()])

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache: every request is prefilled from scratch, so there is nothing stale to drop.
        return web.Response(text="Cache flushed.\n", status=200)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if (refusal := self.memory.weights_refusal()) is not None:
            return json_error(refusal)
        try:
            values = await self.scheduler.run_on_model(self.model.get_weights_by_name, str(body.get("name")),
                                                       int(body.get("truncate_size", 100)))
        except ValueError as exc:
            return json_error(str(exc))
        return web.json_response(values)

    # ---- weights ---------------------------------------------------------------------------------------------

    def _apply_version(self, body: dict[str, Any], message: str) -> str:
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {self.weight_version}."
        return message

    async def _load(self, body: dict[str, Any], fn: Any, *args: Any) -> tuple[bool, str]:
        if (refusal := self.memory.weights_refusal()) is not None:
            return False, f"Failed to update weights: {refusal}"
        if body.get("abort_all_requests"):
            self.scheduler.abort(None)
        if self.opts.drop_weight_updates:
            log.warning("drop_weight_updates: acknowledging a weight update without loading it")
            return True, self._apply_version(body, "Succeeded to update model weights.")
        try:
            count = await self.scheduler.run_on_model(fn, *args)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            return False, f"Failed to update weights: {exc}"
        message = self._apply_version(body, f"Succeeded to update model weights ({count} tensors).")
        log.info("%s", message)
        return True, message

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("new_version") is None:
            return json_result(False, "new_version is required")
        if body.get("abort_all_requests", True):
            self.scheduler.abort(None)
        self.weight_version = str(body["new_version"])
        return json_result(True, f"Weight version updated to {self.weight_version}", new_version=self.weight_version)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if (refusal := self.memory.weights_refusal()) is not None:
            return json_result(False, f"Failed to update weights: {refusal}", num_paused_requests=0)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return json_result(False, f"load_format {body['load_format']!r} is not supported; use None",
                           num_paused_requests=0)
        ok, msg = await self._load(body, self._load_disk, str(body.get("model_path")))
        return json_result(ok, msg, num_paused_requests=0)

    def _load_disk(self, model_path: str) -> int:
        return self.weights.load_full(read_safetensors(model_path))

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """One entry per TP rank. load_format None: base64(torch.save(list[(HF name, full tensor)])), rank r
        slices entry r. A load_format listed in `custom_weight_loader`: rank r calls that function on its own
        parameters with entry r decoded, as SGLang's TP workers do."""
        body = await self._body(request, weights=True)
        if (refusal := self.memory.weights_refusal()) is not None:
            return json_result(False, f"Failed to update weights: {refusal}")
        payloads = body.get("serialized_named_tensors") or []
        if len(payloads) != self.opts.tp:
            return json_result(False, f"serialized_named_tensors needs {self.opts.tp} entries (one per TP rank), "
                                  f"got {len(payloads)}")
        load_format = body.get("load_format")
        if load_format is not None:
            if load_format not in self.opts.custom_weight_loader:
                return json_result(False, f"Unknown load_format={load_format!r}: start the engine with "
                                      f"--custom-weight-loader {load_format} to use it")
            try:
                per_rank = await self.scheduler.run_on_model(self.ranks.custom_load, load_format, list(payloads))
            except Exception as exc:  # anything the plugin raises is reported in the answer
                return json_result(False, f"Failed to update weights: {exc}")
            ok, msg = await self._load(body, self.weights.commit, [n for names in per_rank for n in names])
            return json_result(ok, msg)
        per_rank = []
        for i, payload in enumerate(payloads):
            try:
                per_rank.append(deserialize_named_tensors(payload))
            except Exception as exc:  # any decoding failure is the client's payload
                return json_result(False, f"cannot decode serialized_named_tensors[{i}]: {exc}")
        ok, msg = await self._load(body, self.weights.load_full_per_rank, per_rank)
        return json_result(ok, msg)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Every TP rank r joins as `rank_offset + r`; answers once the whole world has joined."""
        body = await self._body(request)
        name = str(body.get("group_name", "weight_update_group"))
        log.info("joining weight-update group %s at %s:%s as ranks from %s of %s", name, body.get("master_address"),
                 body.get("master_port"), body.get("rank_offset"), body.get("world_size"))
        try:
            # The rendezvous blocks until the trainer joins: keep it off the event loop and the model thread.
            await asyncio.to_thread(
                self.ranks.join, name, str(body.get("backend", "gloo")), str(body["master_address"]),
                int(body["master_port"]), int(body["rank_offset"]), int(body["world_size"]), self.opts.group_timeout_s)
        except Exception as exc:  # any rendezvous failure is reported in the answer, as SGLang does
            return json_result(False, f"Failed to initialize custom process group: {exc!r}.")
        return json_result(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Every TP rank receives the broadcast full tensors and keeps its slices, as SGLang's loaders do."""
        body = await self._body(request)
        name = str(body.get("group_name", "weight_update_group"))
        if (refusal := self.memory.weights_refusal()) is not None:
            return json_result(False, f"Failed to receive parameters: {refusal}")
        load_format = body.get("load_format")
        if load_format is not None:
            return json_result(False, f"load_format {load_format!r} is not supported; use None (one broadcast per "
                                      "tensor)")
        try:
            per_rank = await self.scheduler.run_on_model(
                self.ranks.receive, name, list(body["names"]), list(body["dtypes"]), list(body["shapes"]))
        except (KeyError, ValueError, RuntimeError) as exc:
            return json_result(False, f"Failed to receive parameters: {exc}")
        ok, msg = await self._load(body, self.weights.load_rank_shards, per_rank)
        return json_result(ok, msg)

    # ---- memory (sleep / wake) --------------------------------------------------------------------------------

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """Release `tags` (all when absent): refused while requests are in flight or a tag is released."""
        body = await self._body(request)
        try:
            tags = requested_tags(body.get("tags"))
            load = self.scheduler.load()
            self.memory.check_release(tags, load["num_reqs"] + load["num_waiting_reqs"])
        except MemoryRequestError as exc:
            return json_error(str(exc))
        if "weights" in tags:
            await self.scheduler.run_on_model(self.weights.release, self.opts.enable_weights_cpu_backup)
        self.memory.released.update(tags)
        log.info("released memory %s", tags)
        return web.Response(status=200)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        """Resume released `tags` (all when absent); the weights come back from the rank stores: as they were
        with --enable-weights-cpu-backup, else zeros until a weight update refills them."""
        body = await self._body(request)
        try:
            tags = requested_tags(body.get("tags"))
            self.memory.check_resume(tags)
        except MemoryRequestError as exc:
            return json_error(str(exc))
        if "weights" in tags:
            await self.scheduler.run_on_model(self.weights.resume)
        self.memory.released.difference_update(tags)
        log.info("resumed memory %s", tags)
        return web.Response(status=200)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            existed = await asyncio.to_thread(self.ranks.destroy, str(body.get("group_name", "weight_update_group")))
        except RuntimeError as exc:
            return json_result(False, f"Failed to destroy custom process group: {exc}")
        if not existed:
            return json_result(False, "The group to be destroyed does not exist.")
        return json_result(True, "Succeeded to destroy custom process group.")


def _load_tokenizer(model_path: str) -> Any | None:
    """The model directory's tokenizer if it has one (needed only for stop strings)."""
    import os

    if not any(os.path.exists(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
