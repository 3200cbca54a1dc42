"""Before any work: the run's output and checkpoint directories must be writable and hold a checkpoint.

An unwritable `checkpoint.dir` used to surface at the final save, throwing the whole run away. Here each
directory is created, a probe file is written, fsynced and removed, and the free space is compared with
an estimate of one checkpoint (the new one is written before retention deletes an old one).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from miles_lite.config.schema import MilesConfig

# fp32 master weights plus Adam's two fp32 moments: three fp32 copies of every parameter.
_CHECKPOINT_COPIES = 3
# Tokenizer and config files, pickled driver state and RNG streams.
_CHECKPOINT_EXTRA_BYTES = 4 << 20
_PROBE_BYTES = 1 << 16


class OutputDirError(RuntimeError):
    """A directory the run writes to is missing, unwritable or too full; the message names the field."""


def parameter_count(cfg: MilesConfig) -> int:
    """Parameters of the model the run trains: from `model.hf_path`'s weight files, else from `model.shape`."""
    if cfg.model.hf_path:
        files = [p for p in Path(cfg.model.hf_path).glob("*.safetensors")]
        # Shipped weights are bf16 (2 bytes) at most as often as fp32; count them as bf16 to stay generous.
        return sum(p.stat().st_size for p in files) // 2
    s = cfg.model.shape
    head_dim = s.head_dim or s.hidden_size // s.num_attention_heads
    attn = s.hidden_size * head_dim * (2 * s.num_attention_heads + 2 * s.num_kv_heads)
    mlp = 3 * s.hidden_size * s.ffn_hidden_size
    embed = cfg.model.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return embed + s.num_layers * (attn + mlp)


def checkpoint_bytes(cfg: MilesConfig) -> int:
    """About how many bytes one checkpoint of this run takes."""
    return parameter_count(cfg) * 4 * _CHECKPOINT_COPIES + _CHECKPOINT_EXTRA_BYTES


def probe_dir(path: Path, field: str, need_bytes: int = 0) -> None:
    """Create `path`, write and remove a probe file, check `need_bytes` are free; OutputDirError otherwise."""
    fix = f"set {field} to a writable directory with room for it"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{uuid.uuid4().hex[:8]}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * _PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise OutputDirError(f"{field}={str(path)!r} is not writable ({err.strerror or err}); {fix}") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise OutputDirError(f"{field}={str(path)!r} has {free / 2**20:.1f} MiB free, and one checkpoint of this "
                             f"model takes about {need_bytes / 2**20:.1f} MiB; free space or {fix}")


def probe_run_dirs(cfg: MilesConfig, run_dir: Path, checkpoint_root: Path) -> None:
    """The output directory (`experiment.output_dir`) and the checkpoint root (`checkpoint.dir`; nothing to
    probe when it is empty: the run saves no checkpoint)."""
    ckpt_field = "checkpoint.dir" if cfg.checkpoint.dir else "experiment.output_dir"
    probe_dir(run_dir, "experiment.output_dir")
    if cfg.checkpoint.dir != "":
        probe_dir(checkpoint_root, ckpt_field, checkpoint_bytes(cfg))
