"""The reference engine's LoRA routes, answering as SGLang's `LoRAUpdateOutput` does: `/load_lora_adapter` (a PEFT
directory), `/load_lora_adapter_from_tensors` (the adapter inside the request) and `/unload_lora_adapter`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from miles_lite.engines.reference.lora import LoraAdapters
from miles_lite.engines.reference.scheduler import Scheduler

log = logging.getLogger("miles_lite.reference_engine")

# The server's body reader (bounded, with a deadline): request, weights-sized -> the JSON object.
BodyReader = Callable[[web.Request, bool], Awaitable[dict[str, Any]]]


class LoraRoutes:
    """The LoRA handlers of one reference server: its adapters, the scheduler that runs loads on the model
    thread, whether LoRA is on (`--enable-lora`), its TP size, and its body reader."""

    def __init__(self, adapters: LoraAdapters, scheduler: Scheduler, enabled: bool, tp: int,
                 read_body: BodyReader) -> None:
        self.adapters = adapters
        self.scheduler = scheduler
        self.enabled = enabled
        self.tp = tp
        self.read_body = read_body

    def routes(self) -> list[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]]]:
        return [("POST", "/load_lora_adapter", self.load_lora_adapter),
                ("POST", "/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors),
                ("POST", "/unload_lora_adapter", self.unload_lora_adapter)]

    def _lora_result(self, success: bool, error: str | None = None) -> web.Response:
        return web.json_response({"success": success, "error_message": error,
                                  "loaded_adapters": self.adapters.loaded()}, status=200 if success else 400)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """Load a PEFT directory (`lora_path`) as adapter `lora_name`; the base weights are not touched."""
        body = await self.read_body(request, False)
        if not self.enabled:
            return self._lora_result(False, "LoRA is not enabled: start the engine with --enable-lora")
        try:
            adapter = await self.scheduler.run_on_model(self.adapters.load, str(body.get("lora_name") or ""),
                                                        str(body.get("lora_path") or ""))
        except (ValueError, FileNotFoundError, KeyError) as exc:
            return self._lora_result(False, f"Failed to load LoRA adapter: {exc}")
        log.info("loaded LoRA adapter %s from %s", adapter.name, adapter.path)
        return self._lora_result(True)

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        """Load adapter `lora_name` from `config_dict` and `serialized_named_tensors` (one payload per TP rank,
        each the whole adapter: every rank keeps its own slices, as SGLang's LoRA layers do)."""
        body = await self.read_body(request, True)
        if not self.enabled:
            return self._lora_result(False, "LoRA is not enabled: start the engine with --enable-lora")
        payloads = body.get("serialized_named_tensors") or []
        if not isinstance(payloads, list) or len(payloads) != self.tp:
            return self._lora_result(False, f"serialized_named_tensors needs {self.tp} entries (one per TP "
                                            f"rank), got {len(payloads) if isinstance(payloads, list) else payloads!r}")
        try:
            adapter = await self.scheduler.run_on_model(self.adapters.load_tensors,
                                                        str(body.get("lora_name") or ""), body.get("config_dict"),
                                                        payloads[0])
        except (ValueError, KeyError, TypeError) as exc:
            return self._lora_result(False, f"Failed to load LoRA adapter: {exc}")
        log.info("loaded LoRA adapter %s from the request's tensors (%d bytes)", adapter.name, adapter.nbytes)
        return self._lora_result(True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self.read_body(request, False)
        try:
            self.adapters.unload(str(body.get("lora_name") or ""))
        except ValueError as exc:
            return self._lora_result(False, str(exc))
        return self._lora_result(True)
