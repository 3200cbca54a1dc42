"""What a run records of its configuration, and what a resume may change of it.

Every checkpoint's manifest records the resolved configuration the run trained with and the identity of
the data its prompt cursor indexes (`DriverState.manifest_meta`). Before a resume does any work,
`plan_resume` compares the configuration asked for with the recorded one field by field
(`config.changes` says what each field's change means): changes the checkpoint cannot take are refused
all at once (`ResumeRefused`, each naming the field, the recorded value and the fix); the others are
listed, to be applied and reported. The run directory keeps the configuration of every start
(`record_start_config`): `config.yaml` is the latest, each earlier one is kept beside it as
`config.from_step_<N>.yaml`, N being the step its start began from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_lite.checkpoint.layout import load_manifest
from miles_lite.config.changes import Change, config_changes, config_tree, show
from miles_lite.config.schema import MilesConfig
from miles_lite.data.identity import data_identity, same_data
from miles_lite.formats.files import write_atomic

CONFIG_FILE = "config.yaml"
_HEADER = "# miles-lite: the configuration of the start at step "


class ResumeRefused(ValueError):
    """A resume asked for changes that the checkpoint's weights or data stream cannot take."""


@dataclass
class ResumePlan:
    """What a start continues from and what it changes.

    Attributes:
        checkpoint: the checkpoint resumed (None: a fresh start).
        step: the step it continues from (0: fresh, or weights only).
        changes: the fields that differ from the checkpoint's recorded configuration (none ignored).
        data_changed: the training data differs from the checkpoint's (`checkpoint.allow_data_change`):
            the prompt cursor restarts on the new data.
        recorded: the checkpoint recorded its configuration (older checkpoints and converted HF weights
            do not: nothing can be compared).
        data_note: what the new data is, when it changed.
    """

    checkpoint: Path | None = None
    step: int = 0
    changes: list[Change] = field(default_factory=list)
    data_changed: bool = False
    recorded: bool = False
    data_note: str = ""

    def kind(self, change: Change) -> str:
        """`applied` or `spent` for a change this plan keeps (refused ones never reach a plan)."""
        kind = change.kind
        if kind == "data" or (kind == "spent" and self.data_changed and change.field == "data.shuffle_seed"):
            return "applied"  # same data by content (a moved file), or new data with a fresh cursor
        return kind

    @property
    def applied(self) -> list[Change]:
        return [c for c in self.changes if self.kind(c) == "applied"]

    @property
    def spent(self) -> list[Change]:
        return [c for c in self.changes if self.kind(c) == "spent"]

    def line(self) -> str | None:
        """One line saying what this resume changes, or None when it changes nothing."""
        parts = []
        if self.applied:
            parts.append("applied " + ", ".join(c.describe() for c in self.applied))
        if self.data_changed:
            parts.append(f"the prompt cursor restarts on the new data ({self.data_note})")
        if self.spent:
            parts.append("no effect on this run (the warm-up and presample ran before step 1; the saved prompt "
                         "order continues): " + ", ".join(c.describe() for c in self.spent))
        if not parts:
            return None
        return f"resumed at step {self.step} with changed settings: " + "; ".join(parts)

    def as_json(self) -> dict[str, Any]:
        """What `summary.json` records under `config_changes`."""
        return {"resumed_from": str(self.checkpoint) if self.checkpoint else None, "step": self.step,
                "applied": [c.as_json() for c in self.applied], "no_effect": [c.as_json() for c in self.spent],
                "data_changed": self.data_changed}


def recorded_run(checkpoint: Path) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None]:
    """The step, recorded configuration and data identity of a checkpoint (read from its manifest alone)."""
    manifest = load_manifest(checkpoint)
    return manifest.step, manifest.meta.get("run_config"), manifest.meta.get("data_identity")


def plan_resume(cfg: MilesConfig, checkpoint: Path | None) -> ResumePlan:
    """Compare `cfg` with what `checkpoint` recorded; the plan, or `ResumeRefused` listing every change the
    checkpoint cannot take (each with the recorded value and the fix)."""
    if checkpoint is None:
        return ResumePlan()
    step, recorded_cfg, recorded_data = recorded_run(checkpoint)
    if recorded_cfg is None:
        return ResumePlan(checkpoint, step)
    changes = [c for c in config_changes(recorded_cfg, config_tree(cfg)) if c.kind != "ignored"]
    refused = [f"  {c.field}: the checkpoint has {show(c.old)} (asked: {show(c.new)})"
               for c in changes if c.kind == "refused"]
    tools = [c for c in changes if c.field == "rollout.environment"
             and (c.old == "calculator") != (c.new == "calculator")]
    if tools and cfg.model.hf_path is None:
        # The offline tokenizer of a random model has the calculator's tags as tokens only with that tool.
        refused.append(f"  rollout.environment: the checkpoint has {show(tools[0].old)} (asked: {show(tools[0].new)}); "
                       "the offline tokenizer's calculator tags come and go with it")
    data_changed, note = False, ""
    current_data = data_identity(cfg.data)
    if recorded_data is not None and not same_data(recorded_data, current_data):
        data_fields = ", ".join(c.field for c in changes if c.kind == "data") or "the data's content"
        note = f"{current_data['what']}, was {recorded_data['what']}"
        if cfg.checkpoint.allow_data_change:
            data_changed = True
        else:
            refused.append(f"  data ({data_fields}): the checkpoint's prompt cursor indexes "
                           f"{recorded_data['what']} (asked: {current_data['what']}); "
                           "to continue these weights on the new data from its beginning, set "
                           "checkpoint.allow_data_change=true")
    if refused:
        raise ResumeRefused(
            f"checkpoint {checkpoint} (step {step}) cannot resume with this configuration:\n" + "\n".join(refused)
            + "\nkeep the checkpoint's values, start a new run (another experiment.run_name), or set "
            "checkpoint.resume=none to train this run from the start (its checkpoints are moved aside)")
    return ResumePlan(checkpoint, step, changes, data_changed, recorded=True, data_note=note)


def _started_at(text: str) -> str:
    first = text.split("\n", 1)[0]
    return first[len(_HEADER):].strip() if first.startswith(_HEADER) else "unknown"


def config_body(text: str) -> str:
    """A `config.yaml`'s configuration without its header line."""
    return text.split("\n", 1)[1] if text.startswith(_HEADER) else text


def record_start_config(run_dir: Path, cfg_yaml: str, step: int) -> Path | None:
    """Write `config.yaml` for a start at `step`; an earlier start's different configuration is kept beside it
    as `config.from_step_<N>.yaml` (returned). The same configuration continuing leaves the file as it is."""
    path = run_dir / CONFIG_FILE
    kept = None
    if path.is_file():
        old = path.read_text()
        if config_body(old) == cfg_yaml:
            return None
        started = _started_at(old)
        kept = run_dir / f"config.from_step_{started}.yaml"
        n = 1
        while kept.exists():
            n += 1
            kept = run_dir / f"config.from_step_{started}.{n}.yaml"
        write_atomic(kept, old)  # a copy first: an interruption leaves config.yaml as it was
    write_atomic(path, f"{_HEADER}{step}\n{cfg_yaml}")
    return kept
