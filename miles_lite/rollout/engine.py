"""The RolloutEngine seam: what the rollout manager, the fleet and weight sync need of an engine.

Both engine kinds (stock SGLang servers and the CPU reference engine) speak SGLang's HTTP API, so
one HTTP client (`miles_lite.rollout.http_client.HttpEngine`) implements this protocol for both; they
differ only in how their server process is launched (`miles_lite/engines/`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from miles_lite.types import Generation, SamplingParams

# What an engine can release and resume (SGLang's memory-saver tags, `srt/constants.py`): model weights,
# the KV cache, and captured CUDA graphs. An engine serves requests only with none of them released.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineError(RuntimeError):
    """An engine answered with an error, an unexpected payload, or not at all."""


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine serving one model replica (possibly tensor-parallel inside)."""

    engine_id: str
    url: str

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
                       return_routed_experts: bool = False) -> Generation:
        """Sample one completion of `input_ids` (token ids in, token ids + per-token logprobs out); with
        `return_routed_experts` (MoE models), also the expert ids of every position the engine ran."""

    async def score(self, input_ids: list[int], prompt_len: int) -> list[float]:
        """Logprobs (nats) of tokens `input_ids[prompt_len:]` given their prefixes; no sampling.

        Used by weight-sync verification to compare engine and trainer on a fixed probe.
        """

    async def health(self, timeout_s: float) -> bool:
        """True if the engine can generate a token within `timeout_s` (`/health_generate`)."""

    async def weight_version(self) -> str:
        """The version string of the weights being served (`/model_info`'s `weight_version`)."""

    async def pause(self) -> None:
        """Stop scheduling new work (`/pause_generation`); in-flight requests are kept."""

    async def resume(self) -> None:
        """Continue after `pause` (`/continue_generation`)."""

    async def flush_cache(self) -> None:
        """Drop the prefix cache (stale after a weight update)."""

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by id, or every request when `rid` is None."""

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Load HF safetensors from `model_path` (`/update_weights_from_disk`)."""

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str,
    ) -> None:
        """Join a torch.distributed group with the trainer (`/init_weights_update_group`)."""

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        weight_version: str, flush_cache: bool = True,
    ) -> None:
        """Receive the named tensors over the group (`/update_weights_from_distributed`)."""

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the weight-update group (`/destroy_weights_update_group`)."""

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], load_format: str | None, weight_version: str | None,
        flush_cache: bool = True,
    ) -> None:
        """Load tensors passed by handle/serialisation, one entry per engine TP rank."""

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first `truncate_size` values of a parameter (for checksums)."""

    async def release_memory(self, tags: Sequence[str]) -> None:
        """Free the memory of `tags` (a subset of `MEMORY_TAGS`; `/release_memory_occupation`).

        Only with no request in flight; until every released tag is resumed the engine refuses to
        generate. Released weights may be pushed to only after `resume_memory(["weights"])`.
        """

    async def resume_memory(self, tags: Sequence[str]) -> None:
        """Allocate the memory of released `tags` again (`/resume_memory_occupation`); weights come back
        with the values they had (or receive a push next)."""

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load a PEFT adapter directory under a name requests can pick (`lora_name` below)."""

    async def load_lora_adapter_from_tensors(self, lora_name: str, config: dict[str, Any],
                                             payloads: list[str]) -> dict[str, Any]:
        """Load an adapter sent in the request (its PEFT config and one tensor payload per engine TP rank)."""

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Drop a loaded adapter."""

    async def close(self) -> None:
        """Release the client's connections (does not stop the server)."""
