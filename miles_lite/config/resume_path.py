"""What is wrong with a `checkpoint.resume` path, said so the user can pick a checkpoint that is there.

A path to a step that retention removed (`checkpoint.keep_last` keeps the newest few; `checkpoint.keep_every`
keeps every N-th step for good) names the steps kept; one that a roll-back moved aside (`superseded/`) names
where it went. Read from the file system alone: the configuration is checked before anything is loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

from miles_lite.config.schema import CheckpointConfig

_STEP_DIR = re.compile(r"^step_(\d+)$")  # checkpoint.layout's committed step directories
_SUPERSEDED = "superseded"


def _steps(root: Path) -> list[Path]:
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def resume_problem(ckpt: CheckpointConfig) -> str | None:
    """None when `checkpoint.resume` is auto, none or an existing directory; else the error line."""
    resume = ckpt.resume.strip()
    if resume in ("", "auto", "none") or Path(resume).is_dir():
        return None
    path = Path(resume)
    step = _STEP_DIR.match(path.name)
    if step is None or not path.parent.is_dir():
        return (f"checkpoint.resume={resume!r} does not exist; give auto (the run's newest intact checkpoint), none "
                "(start from step 0), a checkpoint directory (.../checkpoints/step_N) or a directory of them")
    root = path.parent
    moved = sorted((root / _SUPERSEDED).glob(f"*/{path.name}")) if (root / _SUPERSEDED).is_dir() else []
    if moved:
        return (f"checkpoint.resume={resume!r}: that checkpoint was moved to {moved[-1]} when the run went back to an "
                f"earlier step; set checkpoint.resume={moved[-1]}")
    kept = _steps(root)
    if not kept:
        return f"checkpoint.resume={resume!r}: {root} holds no checkpoint (no step_N directory)"
    names = ", ".join(p.name for p in kept)
    return (f"checkpoint.resume={resume!r}: {root} no longer holds step {int(step.group(1))}: it keeps {names} "
            f"(retention keeps the newest checkpoint.keep_last, now {ckpt.keep_last}, and with checkpoint.keep_every "
            f"every N-th step for good); resume from one of those, e.g. checkpoint.resume={kept[-1]}")
