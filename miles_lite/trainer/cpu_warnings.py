"""Megatron's warnings that a CPU run expects, filtered so the console shows what matters.

On a CPU-only machine megatron-core warns, once per import site, that TransformerEngine and Apex are
missing and that it falls back to torch implementations; that is exactly the CPU path (local layer
spec, torch optimizers and norms). On a machine with CUDA the same warnings mean a GPU run lacks its
kernels, so they are left alone there.
"""

from __future__ import annotations

import re
import warnings

EXPECTED_ON_CPU = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed. Falling back to Torch Norm",
)


def filter_expected_cpu_warnings() -> None:
    """Ignore `EXPECTED_ON_CPU` in this process when no CUDA device is usable (call before importing megatron)."""
    import torch

    if torch.cuda.is_available():
        return
    for message in EXPECTED_ON_CPU:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)
