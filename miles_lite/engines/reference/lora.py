"""LoRA adapters on the reference engine, as SGLang serves them: loaded by name from a PEFT directory
(`/load_lora_adapter`) or from the request's tensors (`/load_lora_adapter_from_tensors`), unloaded by name,
chosen per request (`lora_path`), several in one batch.

Each loaded adapter is an immutable `LoadedAdapter`; a request holds the one it named from submission
to its end, so unloading a name never changes what a running request computes. The base weights are
never touched: a forward hook on every adapted projection adds `scale * B @ A @ x` to the rows whose
request uses an adapter.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from miles_lite.formats.lora import LoraSpec, load_adapter_dir, pairs, read_adapter_payload

# The path an adapter loaded from a request's tensors reports (SGLang's `LoRARef.lora_path` for them).
TENSOR_PATH = "__tensor__"


@dataclass(frozen=True, eq=False)
class LoadedAdapter:
    """One adapter version: its name, spec and per-module (A, B) in the model's dtype."""

    name: str
    path: str
    spec: LoraSpec
    modules: dict[str, tuple[Tensor, Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


class LoraAdapters:
    """The adapters loaded into one HF model, and the hooks that apply them per batch row."""

    def __init__(self, model: nn.Module, max_rank: int | None = None) -> None:
        self.model = model
        self.max_rank = max_rank
        self._loaded: dict[str, LoadedAdapter] = {}
        self._hooked: set[str] = set()
        self._rows: Sequence[LoadedAdapter | None] | None = None
        self._lock = threading.Lock()

    # ---- registry -------------------------------------------------------------------------------

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read PEFT directory `path` as adapter `name`; ValueError names what does not fit the model."""
        self._check_name(name)
        spec, tensors = load_adapter_dir(path)
        return self._add(name, path, spec, tensors)

    def load_tensors(self, name: str, config: dict[str, Any], payload: str) -> LoadedAdapter:
        """Adapter `name` from a request: its `adapter_config.json` and `formats.lora.adapter_payload` (the
        path SGLang reports for such adapters, `__tensor__`, stands for it)."""
        self._check_name(name)
        if not isinstance(config, dict):
            raise ValueError("config_dict must be the adapter's adapter_config.json object")
        return self._add(name, TENSOR_PATH, LoraSpec.from_peft_config(config), read_adapter_payload(payload))

    def _check_name(self, name: str) -> None:
        if not name:
            raise ValueError("lora_name is required")
        if name in self._loaded:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it or pick another name")

    def _add(self, name: str, path: str, spec: LoraSpec, tensors: dict[str, Tensor]) -> LoadedAdapter:
        """Serve `tensors` (PEFT names) as adapter `name` (checked by the caller, before reading them); ValueError
        names what does not fit the model."""
        if self.max_rank is not None and spec.rank > self.max_rank:
            raise ValueError(f"adapter rank {spec.rank} exceeds --max-lora-rank {self.max_rank}")
        dtype = next(self.model.parameters()).dtype
        modules: dict[str, tuple[Tensor, Tensor]] = {}
        for module_name, (a, b) in pairs(tensors).items():
            try:
                linear = self.model.get_submodule(module_name)
            except AttributeError:
                raise ValueError(f"adapter targets {module_name}, which the model lacks") from None
            if not isinstance(linear, nn.Linear) or tuple(a.shape) != (spec.rank, linear.in_features) \
                    or tuple(b.shape) != (linear.out_features, spec.rank):
                raise ValueError(f"adapter tensors for {module_name} have shapes A {tuple(a.shape)}, B "
                                 f"{tuple(b.shape)}; the layer needs A [r, {getattr(linear, 'in_features', '?')}], "
                                 f"B [{getattr(linear, 'out_features', '?')}, r]")
            modules[module_name] = (a.to(dtype), b.to(dtype))
        adapter = LoadedAdapter(name, str(path), spec, modules)
        with self._lock:
            for module_name in modules:
                if module_name not in self._hooked:
                    self.model.get_submodule(module_name).register_forward_hook(self._hook(module_name))
                    self._hooked.add(module_name)
            self._loaded[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self._loaded:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self._loaded)})")
        del self._loaded[name]

    def get(self, name: str) -> LoadedAdapter:
        """The adapter a request names in `lora_path`; ValueError when none of that name is loaded."""
        adapter = self._loaded.get(name)
        if adapter is None:
            raise ValueError(f"lora_path {name!r} names no loaded LoRA adapter (loaded: {sorted(self._loaded)}); "
                             "load it with /load_lora_adapter first")
        return adapter

    def loaded(self) -> dict[str, str]:
        """Name -> path of every loaded adapter (SGLang's `loaded_adapters`)."""
        return {n: a.path for n, a in self._loaded.items()}

    # ---- compute --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[LoadedAdapter | None]) -> Iterator[None]:
        """Forward passes in the block apply `adapters[i]` (None: the base) to batch row i."""
        self._rows = adapters if any(a is not None for a in adapters) else None
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, module_name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
            rows = self._rows
            if rows is None:
                return output
            x = args[0]
            out = output.clone()
            for adapter in {id(a): a for a in rows if a is not None}.values():
                pair = adapter.modules.get(module_name)
                if pair is None:
                    continue
                a, b = pair
                index = torch.tensor([i for i, r in enumerate(rows) if r is adapter], dtype=torch.long)
                xs = x.index_select(0, index)
                out.index_add_(0, index, ((xs @ a.t()) @ b.t()) * adapter.spec.scale)
            return out

        return hook
