"""TransformerEngine FP8 recipes behind `trainer.precision=fp8` / `trainer.fp8_recipe` (GPU only).

Megatron enters `fp8_autocast` itself inside every `TransformerBlock` from the `fp8` /
`fp8_recipe` fields of `TransformerConfig`; this module checks up front that the installed TE
provides the recipe asked for, so a missing or too-old TE fails at start-up with the fix, not in
the first forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# trainer.fp8_recipe -> (TE recipe class in transformer_engine.common.recipe, TE format name)
TE_RECIPES: dict[str, tuple[str, str]] = {
    "delayed": ("DelayedScaling", "HYBRID"),
    "tensorwise": ("Float8CurrentScaling", "HYBRID"),
    # Block scaling quantises gradients in E4M3 too (1x128 / 128x128 tiles).
    "blockwise": ("Float8BlockScaling", "E4M3"),
}


def te_recipe(name: str) -> Any:
    """The TE recipe object for `trainer.fp8_recipe=name` (imports TransformerEngine)."""
    if name not in TE_RECIPES:
        raise ValueError(f"trainer.fp8_recipe={name!r} is not one of {', '.join(TE_RECIPES)}")
    try:
        from transformer_engine.common import recipe as te_recipe_mod
    except ImportError as err:
        raise RuntimeError(
            "trainer.precision=fp8 needs TransformerEngine: pip install 'miles-lite[gpu]' on a CUDA machine "
            f"(import failed: {err})"
        ) from err
    cls_name, fmt = TE_RECIPES[name]
    cls = getattr(te_recipe_mod, cls_name, None)
    if cls is None:
        raise RuntimeError(
            f"trainer.fp8_recipe={name} needs transformer_engine.common.recipe.{cls_name}, which the installed "
            "TransformerEngine lacks; upgrade TransformerEngine (>= 2.3 for blockwise) or pick another recipe"
        )
    return cls(fp8_format=getattr(te_recipe_mod.Format, fmt))


def check_te_recipe(name: str) -> None:
    """Raise a clear error unless TransformerEngine can build the `name` recipe here."""
    te_recipe(name)


@contextlib.contextmanager
def fp8_off(config: Any) -> Iterator[None]:
    """Forwards inside run in the weights' own dtype (bf16) instead of FP8.

    `config`: the model's `TransformerConfig`. Megatron decides at every forward whether to enter
    `fp8_autocast` from `config.fp8`, and TransformerEngine keeps the high-precision weights next to
    their FP8 copies, so clearing the field for the duration is enough. The weight-push probe uses
    it: it checks that the engine holds the trainer's weights, and an FP8 forward would add its
    quantisation noise to that comparison.
    """
    saved = config.fp8
    config.fp8 = None
    try:
        yield
    finally:
        config.fp8 = saved
