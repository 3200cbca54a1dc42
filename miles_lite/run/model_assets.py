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
from miles_lite.data.tokenizer import load_or_build_tokenizer
from miles_lite.formats.answer import CALCULATOR_TAGS
from miles_lite.formats.files import write_atomic


def prepare_model(cfg: MilesConfig, run_dir: Path) -> tuple[MilesConfig, Any]:
    """Resolve the model directory and tokenizer; a tiny random model is written under the run dir.

    Returns the config with `model.hf_path` pointing at the directory both roles load, and the tokenizer.
    """
    from transformers import AutoTokenizer

    from miles_lite.trainer.tiny_hf import make_tiny_hf_model

    if cfg.model.hf_path:
        problem = tokenizer_problem(cfg)
        if problem:
            raise ValueError(problem)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
        return cfg, tokenizer
    cache = Path(cfg.experiment.output_dir) / ".cache" / "tokenizers"
    # The calculator's tags are single tokens of the offline tokenizer when a run uses that tool.
    extra_tags = CALCULATOR_TAGS if cfg.rollout.environment == "calculator" else ()
    tokenizer = load_or_build_tokenizer(cache, vocab_size=cfg.model.vocab_size, seed=0, extra_tags=extra_tags)
    if len(tokenizer) > cfg.model.vocab_size:
        raise ValueError(f"the offline tokenizer has {len(tokenizer)} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}; raise model.vocab_size")
    model_dir = run_dir / "initial_model"
    # What the random model is built from: a run started over with another shape (checkpoint.resume=none)
    # builds it again rather than loading the earlier one (the build is seeded: the same spec, the same weights).
    spec = json.dumps({"arch": cfg.model.arch, "shape": dataclasses.asdict(cfg.model.shape),
                       "vocab_size": cfg.model.vocab_size, "tokenizer_tags": list(extra_tags)}, sort_keys=True)
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


