"""A LoRA run's checkpoint out as Hugging Face files: the merged model, or a PEFT adapter directory.

The checkpoint holds the adapters (PEFT names under `model/`) and names its frozen base (`lora.base` in the
shared tree): an HF directory, or the recipe of the seeded tiny model, which is rebuilt bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from miles_lite.checkpoint.resume import CheckpointReader
from miles_lite.checkpoint.trainer_state import MODEL_PREFIX
from miles_lite.formats.lora import LoraSpec, merged_state, save_adapter_dir


def lora_info(reader: CheckpointReader) -> dict[str, Any] | None:
    """The checkpoint's LoRA record (`adapter`: PEFT config, `base`), or None for a full-weight checkpoint."""
    return reader.shared().get("lora")


def adapter_tensors(reader: CheckpointReader) -> dict[str, Tensor]:
    return {name[len(MODEL_PREFIX):]: reader.global_tensor(name) for name in reader.global_names(MODEL_PREFIX)}


def base_state(base: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Tensor]:
    """Full HF tensors of the base a LoRA checkpoint names (lm_head left out when tied to the embeddings)."""
    from miles_lite.config.schema import TinyModelShape
    from miles_lite.trainer.hf_convert import read_hf_state
    from miles_lite.trainer.tiny_hf import build_tiny_hf_model

    if base.get("hf_path"):
        path = Path(base["hf_path"])
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"the checkpoint's base model {path} is not there (no config.json); "
                                    "a LoRA checkpoint needs its base to be merged")
        state = read_hf_state(path)
    else:
        tiny = base["tiny"]
        shape = TinyModelShape(**tiny["shape"])
        state = dict(build_tiny_hf_model(tiny["arch"], shape, int(tiny["vocab_size"]), shape.init_seed).state_dict())
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return state


def write_merged(reader: CheckpointReader, info: Mapping[str, Any], config: Mapping[str, Any], out: str | Path) -> Path:
    """Base + adapters as `model.safetensors` + `config.json` in `out`."""
    from miles_lite.trainer.hf_convert import save_hf_checkpoint

    spec = LoraSpec.from_peft_config(info["adapter"])
    merged = merged_state(base_state(info["base"], config), adapter_tensors(reader), spec)
    return save_hf_checkpoint(merged, config, out)


def write_adapter(reader: CheckpointReader, info: Mapping[str, Any], out: str | Path) -> Path:
    """The adapters as a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`)."""
    spec = LoraSpec.from_peft_config(info["adapter"])
    return save_adapter_dir(out, adapter_tensors(reader), spec, info["base"].get("hf_path"))
