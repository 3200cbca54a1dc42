"""The model directory and tokenizer both roles load: a configured HF directory, or a tiny random model
(seeded, so the trainer and a separately started engine build identical weights) written under the run."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from miles_lite.config.schema import MilesConfig
from miles_lite.config.validate import tokenizer_problem
from miles_lite.data.tokenizer import load_or_build_tokenizer, tokenizer_cache_key
from miles_lite.formats.answer import CALCULATOR_TAGS
from miles_lite.formats.chat import FAMILIES, load_chat_template
from miles_lite.formats.chat.check import generate_conversations
from miles_lite.formats.files import write_atomic


def _agent_vocabulary(cfg: MilesConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tags of the agent sessions' chat template (a tiny model's `auto` is ChatML's qwen2.5), and texts in it
    (generated conversations with tool calls) for the offline tokenizer's merges."""
    name = "qwen2.5" if cfg.rollout.chat_template == "auto" else cfg.rollout.chat_template
    if not cfg.rollout.agent or name not in FAMILIES:
        return (), ()
    template = load_chat_template(name)
    texts = tuple(template.render(c.messages, c.tools, options=c.options)
                  for c in generate_conversations(template, 200, seed=1))
    return template.tags, texts


def _extra_vocabulary(cfg: MilesConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Tags the offline tokenizer keeps as single tokens, and texts it learns merges from: the calculator's tags
    when a run uses that tool; the chat template's tool-call tags (<tool_call> ...) in agent runs."""
    return (CALCULATOR_TAGS, ()) if cfg.rollout.environment == "calculator" else _agent_vocabulary(cfg)


def run_tokenizer(cfg: MilesConfig) -> Any:
    """The tokenizer both roles use: `model.tokenizer_path` / `model.hf_path`'s, or the offline one of a random
    model (built once into `<experiment.output_dir>/.cache/tokenizers`)."""
    if cfg.model.hf_path:
        from transformers import AutoTokenizer

        problem = tokenizer_problem(cfg)
        if problem:
            raise ValueError(problem)
        return AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    cache = Path(cfg.experiment.output_dir) / ".cache" / "tokenizers"
    extra_tags, extra_texts = _extra_vocabulary(cfg)
    tokenizer = load_or_build_tokenizer(cache, vocab_size=cfg.model.vocab_size, seed=0, extra_tags=extra_tags,
                                        extra_texts=extra_texts)
    if len(tokenizer) > cfg.model.vocab_size:
        raise ValueError(f"the offline tokenizer has {len(tokenizer)} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}; raise model.vocab_size")
    return tokenizer


def model_context(cfg: MilesConfig) -> tuple[int | None, str]:
    """The positions one sequence (prompt and completion) may take, and where that figure comes from: SGLang's
    `context_length` when set, else the model's `max_position_embeddings` (config.json, or `model.shape`);
    None when config.json does not say."""
    from miles_lite.config.engine_flags import flag_value

    given = flag_value(cfg.rollout.sglang_args, "context_length") if cfg.rollout.backend == "sglang" else None
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return given, "rollout.sglang_args.context_length"
    if not cfg.model.hf_path:
        return cfg.model.shape.max_position_embeddings, "model.shape.max_position_embeddings"
    config = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("max_position_embeddings", config.get("max_position_embeddings"))
    return (int(size), f"max_position_embeddings in {cfg.model.hf_path}") if isinstance(size, int) else (None, "")


def prepare_model(cfg: MilesConfig, run_dir: Path) -> tuple[MilesConfig, Any]:
    """Resolve the model directory and tokenizer; a tiny random model is written under the run dir.

    Returns the config with `model.hf_path` pointing at the directory both roles load, and the tokenizer.
    """
    from miles_lite.trainer.tiny_hf import make_tiny_hf_model

    tokenizer = run_tokenizer(cfg)
    if cfg.model.hf_path:
        return cfg, tokenizer
    extra_tags, extra_texts = _extra_vocabulary(cfg)
    model_dir = run_dir / "initial_model"
    # What the random model is built from: a run started over with another shape (checkpoint.resume=none)
    # builds it again rather than loading the earlier one (the build is seeded: the same spec, the same weights).
    spec = json.dumps({"arch": cfg.model.arch, "shape": dataclasses.asdict(cfg.model.shape),
                       "vocab_size": cfg.model.vocab_size, "tokenizer_tags": list(extra_tags),
                       **({"tokenizer_texts": tokenizer_cache_key(extra_texts=extra_texts)} if extra_texts else {})},
                      sort_keys=True)
    spec_file = model_dir / "miles_lite_spec.json"
    if model_dir.exists() and (not spec_file.is_file() or spec_file.read_text() != spec):
        shutil.rmtree(model_dir)
    if not (model_dir / "config.json").is_file():
        make_tiny_hf_model(cfg.model.arch, cfg.model.shape, cfg.model.vocab_size, model_dir,
                           seed=cfg.model.shape.init_seed)
        tokenizer.save_pretrained(str(model_dir))
        write_atomic(spec_file, spec)  # last: the directory is complete once its spec is there
    model = dataclasses.replace(cfg.model, hf_path=str(model_dir), tokenizer_path=str(model_dir))
    return dataclasses.replace(cfg, model=model), tokenizer


def run_chat_template(cfg: MilesConfig, tokenizer: Any) -> Any:
    """The agent sessions' chat template (`rollout.chat_template`, checked on `tokenizer`); None without
    `rollout.agent` (prompts then render with the tokenizer's own template)."""
    if not cfg.rollout.agent:
        return None
    from miles_lite.config.views import EngineFleetConfig
    from miles_lite.engines.fleet_launch import chat_template_of

    return chat_template_of(EngineFleetConfig.of(cfg), tokenizer)
