"""A CPU start of the trainer prints none of megatron's warnings about TransformerEngine and Apex (the CPU
path uses torch's implementations on purpose), nor its deprecation of the default CUDA-graph scope."""

from __future__ import annotations

import subprocess
import sys

import torch

# Imports megatron the way a trainer rank does (through miles_lite.trainer), builds a layer spec and a
# TransformerConfig.
SCRIPT = """
from miles_lite.trainer.actor import TrainerActor
from miles_lite.trainer.model import build_transformer_config, resolve_runtime, spec_from_hf_config
from miles_lite.config.schema import TrainerConfig
from transformers import Qwen2Config
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
import warnings
get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")
trainer = TrainerConfig(device="cpu", layer_spec="local")
hf = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128)
build_transformer_config(spec_from_hf_config(hf), trainer, resolve_runtime(trainer))
warnings.warn("an unrelated warning still shows")
print("built")
"""


def test_cpu_start_prints_no_expected_megatron_warnings() -> None:
    assert not torch.cuda.is_available()
    proc = subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", SCRIPT], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "built" in proc.stdout, proc.stderr[-2000:]
    assert "Transformer Engine and Apex are not installed" not in proc.stderr
    assert "Apex is not installed" not in proc.stderr and "full scope is deprecated" not in proc.stderr
    assert "an unrelated warning still shows" in proc.stderr
