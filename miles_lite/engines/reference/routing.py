"""The experts a mixture-of-experts model routes each token to, captured as SGLang returns them.

SGLang (`--enable-return-routed-experts`, `return_routed_experts` per request) answers with
`meta_info.routed_experts`: base64 of an int32 array `[prompt + completion - 1, num_hidden_layers, top_k]`,
one row per position the model ran (the last sampled token is never fed back), dense layers all zero.
The reference engine records the same from forward hooks on transformers' top-k routers.
"""

from __future__ import annotations

import base64

import numpy as np
import torch


class RoutingCapture:
    """Forward hooks on every MoE router of an HF model; `take()` returns the last forward's ids."""

    def __init__(self, routers: list[tuple[int, torch.nn.Module]], num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self._last: dict[int, torch.Tensor] = {}
        for layer, module in routers:
            module.register_forward_hook(self._hook(layer))

    @staticmethod
    def attach(model: torch.nn.Module, config: object) -> RoutingCapture | None:
        """Hooks on `model.layers.{i}.mlp.gate` top-k routers (Qwen3-MoE layout); None for a dense model."""
        routers = []
        for name, module in model.named_modules():
            parts = name.split(".")
            if parts[-2:] == ["mlp", "gate"] and hasattr(module, "top_k") and "layers" in parts:
                routers.append((int(parts[parts.index("layers") + 1]), module))
        if not routers:
            return None
        return RoutingCapture(routers, int(config.num_hidden_layers), int(routers[0][1].top_k))

    def _hook(self, layer: int):  # noqa: ANN202 - torch hook signature
        def hook(_module: torch.nn.Module, _args: object, output: tuple[torch.Tensor, ...]) -> None:
            self._last[layer] = output[2].detach()  # (router_logits, scores, indices [N, k])
        return hook

    def take(self, rows: int, width: int) -> np.ndarray:
        """`[rows, width, num_hidden_layers, top_k]` int32 ids of the last forward over a `[rows, width]`
        batch (dense layers zero), and forget them."""
        out = np.zeros((rows, width, self.num_layers, self.top_k), dtype=np.int32)
        for layer, ids in self._last.items():
            out[:, :, layer, :] = ids.reshape(rows, width, self.top_k).cpu().numpy()
        self._last = {}
        return out


def encode_routed(rows: np.ndarray) -> str:
    """SGLang's wire form: base64 of the int32 array's bytes."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed(payload: str, num_layers: int, top_k: int) -> np.ndarray:
    """Inverse of `encode_routed`: `[positions, num_layers, top_k]` int32."""
    flat = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise ValueError(f"routed_experts holds {flat.size} ids, not a multiple of {num_layers} layers x {top_k}")
    return flat.reshape(-1, num_layers, top_k)
