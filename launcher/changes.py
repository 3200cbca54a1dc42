"""What an edit of a MilesJob's spec does to the job's pods, decided before anything is touched.

The spec the operator last applied is recorded in the job's ConfigMap (`milesjob.json`). An edit is compared
with it through the objects both render to:

- scaling (only `rollout.engines` differs): engine pods are added or removed; the trainer Job is not
  touched, and the trainer's fleet admits or drops the engines as the ConfigMap's engine list changes;
- engine change (the engine pods' template differs): engine pods are replaced; the trainer keeps running
  and its fleet re-admits each replacement after a weight push;
- trainer restart (the trainer Job's template differs: overrides, image, trainer resources, ...): the trainer
  Job is replaced and resumes from its newest checkpoint. Once the trainer has run, that needs a persistent
  checkpoint volume (the same one): without it the restart would start again at step 0, so the edit is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.render import HASH_ANNOTATION
from launcher.spec import JobSpec

SPEC_FILE = "milesjob.json"


class EditRefused(ValueError):
    """An edit the operator will not apply; `reason` is the InvalidSpec condition's reason."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


def applied_spec(config_map: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The spec the operator last applied, from the job's live ConfigMap (None before the first apply)."""
    text = ((config_map or {}).get("data") or {}).get(SPEC_FILE)
    if not text:
        return None
    try:
        spec = json.loads(text)
    except ValueError:
        return None
    return spec if isinstance(spec, dict) else None


def spec_diff(old: Any, new: Any, path: str = "spec") -> list[str]:
    """Dotted paths where two specs differ (lists compare whole)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += spec_diff(old.get(key), new.get(key), f"{path}.{key}")
        return out
    return [] if old == new else [path]


def _hash(obj: Mapping[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("annotations", {}).get(HASH_ANNOTATION)


def _by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


@dataclass(frozen=True)
class Change:
    """An edit from the applied spec to a new one, by its effect on the job's pods."""

    fields: tuple[str, ...]
    engines_from: int
    engines_to: int
    trainer_restart: bool
    engines_replaced: bool

    @property
    def scaling(self) -> bool:
        return self.engines_from != self.engines_to

    def describe(self) -> str:
        return ", ".join(self.fields) or "nothing"


def classify(old_spec: Mapping[str, Any], new_spec: Mapping[str, Any], old_objs: list[dict[str, Any]],
             new_objs: list[dict[str, Any]]) -> Change:
    """The effect of replacing `old_spec` (rendered as `old_objs`) with `new_spec` (`new_objs`)."""
    old_pods, new_pods = _by_kind(old_objs, "Pod"), _by_kind(new_objs, "Pod")
    trainer_old, trainer_new = _by_kind(old_objs, "Job"), _by_kind(new_objs, "Job")
    common = set(old_pods) & set(new_pods)
    return Change(
        fields=tuple(spec_diff(old_spec, new_spec)),
        engines_from=len(old_pods),
        engines_to=len(new_pods),
        trainer_restart=[_hash(o) for o in trainer_old.values()] != [_hash(o) for o in trainer_new.values()],
        engines_replaced=any(_hash(old_pods[n]) != _hash(new_pods[n]) for n in common),
    )


def check_restart(change: Change, old: JobSpec, new: JobSpec, trainer_started: bool, step: int | None) -> None:
    """Raise EditRefused when `change` would restart a trainer that has run without keeping its checkpoints."""
    if not change.trainer_restart or not trainer_started:
        return
    progress = f"step {step}" if step is not None else "its progress"
    fix = ("revert the edit (the job keeps running with its current spec), or create a new job with "
           "spec.checkpoint.volume")
    if old.checkpoint.claim_name is None:
        raise EditRefused("NoCheckpointVolume", (
            f"{change.describe()} changed: applying it restarts the trainer, and this job has no "
            f"spec.checkpoint.volume, so the restarted trainer would lose {progress} and start again at step 0; "
            f"{fix}"))
    if new.checkpoint.claim_name != old.checkpoint.claim_name or new.checkpoint.mount_path != old.checkpoint.mount_path:
        raise EditRefused("CheckpointVolumeChanged", (
            f"{change.describe()} changed: the restarted trainer would not find its checkpoints on "
            f"{old.checkpoint.claim_name!r} at {old.checkpoint.mount_path} and would start again at step 0; "
            f"keep spec.checkpoint.volume as it is"))
