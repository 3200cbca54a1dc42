"""The reference engine's LoRA routes, answering as SGLang's `LoRAUpdateOutput` does: `/load_lora_adapter` (a PEFT
directory), `/load_lora_adapter_from_tensors` (the adapter inside the request) and `/unload_lora_adapter`."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

log = logging.getLogger("miles_lite.reference_engine")


class LoraRoutes:
    """LoRA handlers of `ReferenceServer` (its options, model, scheduler and body reader)."""

    opts: Any
    model: Any
    scheduler: Any

    async def _body(self, request: web.Request, weights: bool = False) -> dict[str, Any]:
        raise NotImplementedError  # the server's own reader (bounded, with a deadline) serves these routes

    def _lora_result(self, success: bool, error: str | None = None) -> web.Response:
        return web.json_response({"success": success, "error_message": error,
                                  "loaded_adapters": self.model.lora.loaded()}, status=200 if success else 400)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """Load a PEFT directory (`lora_path`) as adapter `lora_name`; the base weights are not touched."""
        body = await self._body(request)
        if not self.opts.enable_lora:
            return self._lora_result(False, "LoRA is not enabled: start the engine with --enable-lora")
        try:
            adapter = await self.scheduler.run_on_model(self.model.lora.load, str(body.get("lora_name") or ""),
                                                        str(body.get("lora_path") or ""))
        except (ValueError, FileNotFoundError, KeyError) as exc:
            return self._lora_result(False, f"Failed to load LoRA adapter: {exc}")
        log.info("loaded LoRA adapter %s from %s", adapter.name, adapter.path)
        return self._lora_result(True)

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        """Load adapter `lora_name` from `config_dict` and `serialized_named_tensors` (one payload per TP rank,
        each the whole adapter: every rank keeps its own slices, as SGLang's LoRA layers do)."""
        body = await self._body(request, weights=True)
        if not self.opts.enable_lora:
            return self._lora_result(False, "LoRA is not enabled: start the engine with --enable-lora")
        payloads = body.get("serialized_named_tensors") or []
        if not isinstance(payloads, list) or len(payloads) != self.opts.tp:
            return self._lora_result(False, f"serialized_named_tensors needs {self.opts.tp} entries (one per TP "
                                            f"rank), got {len(payloads) if isinstance(payloads, list) else payloads!r}")
        try:
            adapter = await self.scheduler.run_on_model(self.model.lora.load_tensors,
                                                        str(body.get("lora_name") or ""), body.get("config_dict"),
                                                        payloads[0])
        except (ValueError, KeyError, TypeError) as exc:
            return self._lora_result(False, f"Failed to load LoRA adapter: {exc}")
        log.info("loaded LoRA adapter %s from the request's tensors (%d bytes)", adapter.name, adapter.nbytes)
        return self._lora_result(True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            self.model.lora.unload(str(body.get("lora_name") or ""))
        except ValueError as exc:
            return self._lora_result(False, str(exc))
        return self._lora_result(True)
