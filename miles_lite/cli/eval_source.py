"""What `miles-lite eval` evaluates: MODEL_OR_CKPT resolved to an HF directory with weights, and the configuration
of the run that made it (its task: data source, key mapping, rewards, evaluation sets).

MODEL_OR_CKPT may be
- a run directory (`config.yaml` + its checkpoints): its newest intact checkpoint, with the run's configuration;
- a checkpoint (`.../checkpoints/step_N`, with `manifest.json`) or a directory of them (the newest intact one),
  with the configuration the checkpoint recorded;
- an HF model directory (`config.json` and weights), with the project's default configuration.
A checkpoint is converted to an HF directory in a temporary folder (its `hf/` folder holds only the config
and the tokenizer: it is refused as a model, naming the checkpoint to pass instead).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from miles_lite.checkpoint.layout import ASSETS_DIR, MANIFEST, list_step_dirs, load_manifest
from miles_lite.checkpoint.resume import newest_intact
from miles_lite.run.record import CONFIG_FILE, config_body

WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class SourceError(ValueError):
    """MODEL_OR_CKPT names nothing `miles-lite eval` can load; the message says what to pass."""


@dataclass(frozen=True)
class EvalSource:
    """An HF directory with weights, the configuration recorded with it, and how to name it."""

    model_dir: Path
    recorded: str | None  # YAML of the run's resolved configuration; None: a plain HF model
    what: str


def has_weights(path: Path) -> bool:
    return any(next(path.glob(pattern), None) is not None for pattern in WEIGHT_FILES)


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def _log(message: str) -> None:
    print(f"miles-lite eval: {message}", file=sys.stderr)


def _checkpoint_config(checkpoint: Path) -> str | None:
    from omegaconf import OmegaConf

    recorded = load_manifest(checkpoint).meta.get("run_config")
    return OmegaConf.to_yaml(OmegaConf.create(recorded)) if isinstance(recorded, dict) else None


def _convert(checkpoint: Path, tmp: Path) -> Path:
    from miles_lite.cli.convert import to_hf

    out = tmp / f"hf-{checkpoint.name}"
    try:
        return to_hf(checkpoint, out)
    except (FileNotFoundError, ValueError) as err:
        raise SourceError(f"checkpoint {checkpoint} cannot be evaluated: {err}") from None


def _run_checkpoints(run_dir: Path, recorded: str) -> Path:
    """The run's checkpoint root: its `checkpoint.dir`, else `<run>/checkpoints`."""
    import yaml

    ckpt_dir = ((yaml.safe_load(recorded) or {}).get("checkpoint") or {}).get("dir")
    return Path(ckpt_dir) if ckpt_dir else run_dir / "checkpoints"


def resolve_source(arg: str, tmp: Path) -> EvalSource:
    """MODEL_OR_CKPT as an `EvalSource` (checkpoints converted under `tmp`); SourceError naming the fix."""
    path = Path(arg)
    if not path.exists():
        raise SourceError(f"MODEL_OR_CKPT={arg!r} does not exist")
    if (path / MANIFEST).is_file():
        return EvalSource(_convert(path, tmp), _checkpoint_config(path), f"{path} (checkpoint step {_step(path)})")
    if (path / CONFIG_FILE).is_file():
        recorded = config_body((path / CONFIG_FILE).read_text())
        root = _run_checkpoints(path, recorded)
        found = newest_intact(root, _log) if root.is_dir() else None
        if found is None:
            initial = path / "initial_model"
            hint = f"; its model before RL is {initial}" if has_weights(initial) else ""
            raise SourceError(f"run {path} has no intact checkpoint in {root} (it stopped before its first RL step, "
                              f"or its checkpoints are gone){hint}")
        return EvalSource(_convert(found, tmp), recorded, f"{path} (checkpoint step {_step(found)})")
    if path.is_dir() and list_step_dirs(path):
        found = newest_intact(path, _log)
        if found is None:
            raise SourceError(f"{path} holds no intact checkpoint (every step_N failed its checksums)")
        return EvalSource(_convert(found, tmp), _checkpoint_config(found), f"{found} (checkpoint step {_step(found)})")
    if (path / "config.json").is_file():
        if has_weights(path):
            return EvalSource(path, None, str(path))
        if path.name == ASSETS_DIR and (path.parent / MANIFEST).is_file():
            raise SourceError(f"{path} is the {ASSETS_DIR}/ folder of checkpoint {path.parent}: the model's config and "
                              f"tokenizer, no weights; pass the checkpoint itself: miles-lite eval {path.parent} ...")
        raise SourceError(f"{path} has config.json but no weights ({', '.join(WEIGHT_FILES)}); pass an HF model "
                          "directory with its weights, a checkpoint or a run directory")
    raise SourceError(f"MODEL_OR_CKPT={arg!r} is none of: a run directory ({CONFIG_FILE} and checkpoints), a "
                      f"checkpoint ({MANIFEST}), a directory of checkpoints (step_N), an HF model directory "
                      "(config.json + weights)")


def _step(checkpoint: Path) -> int:
    try:
        return int(json.loads((checkpoint / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return -1
