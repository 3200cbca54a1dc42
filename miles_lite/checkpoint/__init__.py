"""Async sharded checkpoints: host snapshot, background flush, atomic commit, verified resume.

Modules: `payload` (what a rank saves), `async_ckpt` (snapshot + background writer, one save in
flight), `writer` (per-rank files, rank-0 commit), `layout` (directory layout, manifest, atomic
commit, retention), `resume` (find and read checkpoints, checksums), `driver_state` (the driver's
resumable state), `trainer_state` (TrainerActor <-> TP-independent payload), `run_state` (what the
driver calls). A role: it may import the trainer's layouts, the libraries and the shared types; `miles-lite
convert` (`cli/convert.py`) drives it from the command line.
"""

from miles_lite.checkpoint.async_ckpt import AsyncCheckpointer, SaverState, SaveStats
from miles_lite.checkpoint.driver_state import DriverState
from miles_lite.checkpoint.payload import CheckpointPayload, GlobalPiece
from miles_lite.checkpoint.resume import CheckpointReader, ChecksumMismatchError, newest_complete, resolve_resume
from miles_lite.checkpoint.writer import CheckpointSaveError

__all__ = [
    "AsyncCheckpointer",
    "CheckpointPayload",
    "CheckpointReader",
    "CheckpointSaveError",
    "ChecksumMismatchError",
    "DriverState",
    "GlobalPiece",
    "SaveStats",
    "SaverState",
    "newest_complete",
    "resolve_resume",
]
