"""Sleep and wake of the reference engine: which memory tags it has released, and what that forbids.

The tags are SGLang's (`MEMORY_TAGS`). Releasing `weights` frees the model the engine computes with. As on
SGLang, what comes back depends on `--enable-weights-cpu-backup`: with it the TP ranks' stores (where pushes
land) keep a host copy and resuming re-assembles the model from them bit for bit; without it (the default,
SGLang's too) the released weights are lost (zeros) until a weight update after the resume. The engine keeps a KV
cache only while requests run, and memory is released only with none in flight (SGLang asserts the same),
so releasing `kv_cache` frees the running batch's cache (there is none) and `cuda_graph` holds nothing on
a CPU; both still count as released: until every tag is resumed the engine refuses to generate, exactly
as an SGLang engine must not be asked to.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_lite.rollout.engine import MEMORY_TAGS


class MemoryRequestError(ValueError):
    """A release or resume the engine cannot do now (unknown tag, already released, not released, busy)."""


def requested_tags(raw: object) -> list[str]:
    """The tags of a `/release_memory_occupation` or `/resume_memory_occupation` body: None or [] = all."""
    if raw is None or raw == []:
        return list(MEMORY_TAGS)
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise MemoryRequestError(f"tags must be a list of strings out of {list(MEMORY_TAGS)}, got {raw!r}")
    unknown = [t for t in raw if t not in MEMORY_TAGS]
    if unknown:
        raise MemoryRequestError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(raw))


class EngineMemory:
    """The released tags: `awake` (none released) -> asleep (some released) -> awake again."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    def check_release(self, tags: Sequence[str], requests_in_flight: int) -> None:
        if requests_in_flight:
            raise MemoryRequestError(f"{requests_in_flight} requests are in flight; memory is released only when "
                                     "none is (abort or finish them first)")
        again = sorted(set(tags) & self.released)
        if again:
            raise MemoryRequestError(f"memory tags {again} are released already")

    def check_resume(self, tags: Sequence[str]) -> None:
        missing = sorted(set(tags) - self.released)
        if missing:
            raise MemoryRequestError(f"memory tags {missing} are not released; released: {sorted(self.released)}")

    def serving_refusal(self) -> str | None:
        """Why the engine cannot generate now (None: it can)."""
        if not self.released:
            return None
        return (f"the engine's memory is released ({', '.join(t for t in MEMORY_TAGS if t in self.released)}): "
                f"resume it with /resume_memory_occupation before generating")

    def weights_refusal(self) -> str | None:
        """Why the weights cannot be read or written now (None: they can)."""
        if "weights" not in self.released:
            return None
        return "the engine's weights are released: resume them with /resume_memory_occupation (tags weights) first"
