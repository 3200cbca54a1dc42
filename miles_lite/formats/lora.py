"""LoRA adapters in PEFT's format: tensor names, `adapter_config.json`, and merging into a base model.

Shared by the trainer (which names its adapter tensors this way), the checkpoint converter, the weight
push and the reference engine, so that an adapter directory written by one is read by the others and by
`peft.PeftModel.from_pretrained`. Names follow PEFT's saved state dict for a causal LM:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (A: [r, in], B: [out, r]); a
projection's output gains `alpha / r * B @ A @ x`.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# PEFT target name -> the projection's path under `model.layers.{i}.` of an HF Qwen2/Llama/Qwen3 model.
MODULE_PATHS: dict[str, str] = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
TARGETS: tuple[str, ...] = tuple(MODULE_PATHS)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_NAME = re.compile(r"^base_model\.model\.(model\.layers\.\d+\.[a-z_]+\.[a-z_]+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's hyper-parameters: rank r, alpha (output scale alpha / r), dropout, PEFT target names."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}: {unknown or 'none given'}; "
                             f"choose from {list(TARGETS)}")
        # One order for every spec of the same targets (PEFT lists them as a set).
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str | None) -> dict[str, object]:
        """The `adapter_config.json` PEFT writes for a LoRA on a causal LM."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
            "target_modules": sorted(self.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True, "layers_to_transform": None, "layers_pattern": None,
        }

    @classmethod
    def from_peft_config(cls, config: Mapping[str, object]) -> LoraSpec:
        """Read an `adapter_config.json` (only plain LoRA: no rslora, DoRA or bias)."""
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"adapter_config.json peft_type={config.get('peft_type')!r}; only LORA is supported")
        for flag in ("use_rslora", "use_dora"):
            if config.get(flag):
                raise ValueError(f"adapter_config.json {flag}=true is not supported")
        if config.get("bias", "none") != "none":
            raise ValueError(f"adapter_config.json bias={config.get('bias')!r}; only 'none' is supported")
        targets = config.get("target_modules") or []
        if isinstance(targets, str):
            raise ValueError(f"adapter_config.json target_modules={targets!r}: list the module names instead")
        return cls(int(config["r"]), float(config["lora_alpha"]),  # type: ignore[arg-type]
                   float(config.get("lora_dropout") or 0.0), tuple(str(t) for t in targets))  # type: ignore[union-attr]


def module_name(layer: int, target: str) -> str:
    """HF name of the adapted projection, e.g. `model.layers.0.self_attn.q_proj`."""
    return f"model.layers.{layer}.{MODULE_PATHS[target]}"


def tensor_name(layer: int, target: str, which: str) -> str:
    """PEFT state-dict name of an adapter matrix (`which`: "A" or "B")."""
    return f"{_PEFT_PREFIX}{module_name(layer, target)}.lora_{which}.weight"


def split_name(name: str) -> tuple[str, str]:
    """(HF module name, "A" | "B") of a PEFT adapter tensor name; ValueError for anything else."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a PEFT LoRA tensor name (base_model.model.<module>.lora_A|B.weight)")
    return match.group(1), match.group(2)


def pairs(adapter: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """HF module name -> (A, B) of an adapter state dict; raises on a half pair."""
    found: dict[str, dict[str, Tensor]] = {}
    for name, tensor in adapter.items():
        module, which = split_name(name)
        found.setdefault(module, {})[which] = tensor
    half = sorted(m for m, ab in found.items() if len(ab) != 2)
    if half:
        raise ValueError(f"adapter tensors lack lora_A or lora_B for {half[:4]}")
    return {m: (ab["A"], ab["B"]) for m, ab in found.items()}


@torch.no_grad()
def merged_state(base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], spec: LoraSpec) -> dict[str, Tensor]:
    """`base` (full HF tensors) with `W + scale * B @ A` for every adapted projection (fp32 sum, base dtype)."""
    out = dict(base)
    for module, (a, b) in pairs(adapter).items():
        key = f"{module}.weight"
        if key not in out:
            raise KeyError(f"the adapter targets {module}, which the base model lacks")
        w = out[key]
        out[key] = (w.float() + spec.scale * (b.float() @ a.float())).to(w.dtype)
    return out


def save_adapter_dir(out: str | Path, adapter: Mapping[str, Tensor], spec: LoraSpec,
                     base_model: str | None) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT's layout) into `out`."""
    from safetensors.torch import save_file

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    pairs(adapter)  # refuses stray names before anything is written
    save_file({n: t.detach().cpu().contiguous() for n, t in adapter.items()}, str(root / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(spec.peft_config(base_model), indent=2))
    return root


def load_adapter_dir(path: str | Path) -> tuple[LoraSpec, dict[str, Tensor]]:
    """Read a PEFT adapter directory; its spec and tensors (names as saved)."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{root} is not a LoRA adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    spec = LoraSpec.from_peft_config(json.loads((root / CONFIG_FILE).read_text()))
    tensors = load_file(str(root / WEIGHTS_FILE))
    pairs(tensors)
    return spec, tensors


def adapter_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adapter_payload(adapter: Mapping[str, Tensor]) -> str:
    """An adapter's tensors as `/load_lora_adapter_from_tensors` takes them: base64 of a pickled
    `{PEFT name: CPU tensor}` whose bytes travel inside the request (SGLang's `MultiprocessingSerializer`
    reads it; no shared memory, file or CUDA handle, so the engine may be on any machine)."""
    pairs(adapter)  # refuses stray names before anything is sent
    cpu = {str(n): t.detach().to("cpu", copy=True).contiguous() for n, t in adapter.items()}
    return base64.b64encode(pickle.dumps(cpu, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles plain containers of CPU tensors and nothing else: no class of the payload's choosing runs."""

    ALLOWED = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2")}

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a LoRA adapter payload may hold tensors only, not {module}.{name}")


def _storage_from_bytes(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=True)


def read_adapter_payload(payload: str | bytes) -> dict[str, Tensor]:
    """Inverse of `adapter_payload`; ValueError for anything that is not a `{PEFT name: tensor}` mapping."""
    try:
        data = _TensorUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, RuntimeError) as exc:
        raise ValueError(f"cannot decode the adapter payload: {exc}") from None
    if not isinstance(data, Mapping) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in data.items()):
        raise ValueError("an adapter payload must decode to a mapping of PEFT tensor names to tensors")
    tensors = dict(data)
    pairs(tensors)
    return tensors
