"""What the rollout manager needs to know about one prompt, and the sampling settings from config."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles_lite.config.schema import RolloutConfig
from miles_lite.types import PromptSpec, SamplingParams

PromptLike = PromptSpec | tuple[int, Sequence[int], Any]


def _meta_field(meta: Any, name: str, default: Any) -> Any:
    if isinstance(meta, Mapping):
        return meta.get(name, default)
    return getattr(meta, name, default)


def as_prompt_spec(item: PromptLike) -> PromptSpec:
    """Normalise a `PromptSpec` or a `(prompt_index, prompt_ids, metadata)` tuple.

    `metadata` may be a `MathProblem`, any object or mapping with `question`, `answer`, `steps`
    and optionally `prompt_text`, or None (no reference data: rewards cannot score it).
    """
    if isinstance(item, PromptSpec):
        return item
    if not isinstance(item, tuple) or len(item) != 3:
        raise TypeError(
            f"a prompt must be a PromptSpec or a (prompt_index, prompt_ids, metadata) tuple, got {item!r:.80}"
        )
    index, ids, meta = item
    return PromptSpec(
        prompt_index=int(index),
        prompt_ids=tuple(int(t) for t in ids),
        prompt_text=str(_meta_field(meta, "prompt_text", "") or ""),
        question=str(_meta_field(meta, "question", "") or ""),
        answer=float(_meta_field(meta, "answer", 0.0) or 0.0),
        steps=tuple(float(s) for s in (_meta_field(meta, "steps", ()) or ())),
        record=meta if hasattr(meta, "columns") else None,
    )


def sampling_from_config(cfg: RolloutConfig, *, stop_token_ids: Sequence[int] = (),
                         seed: int | None = None) -> SamplingParams:
    """Sampling parameters of one rollout request from `cfg.rollout` (temperature, top-p/k, stops)."""
    if cfg.max_new_tokens < 1:
        raise ValueError(f"rollout.max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0:
        raise ValueError(f"rollout.temperature must be >= 0, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"rollout.top_p must be in (0, 1], got {cfg.top_p}")
    return SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        stop=tuple(cfg.stop),
        stop_token_ids=tuple(stop_token_ids),
        seed=seed,
    )
