"""The reference engine's model: an HF transformers causal LM with a left-padded, batched KV cache.

Rows of a batch are left-padded so that every row's newest token sits in the last column; the attention mask
marks real tokens and `position_ids` are each row's own positions, so padding changes nothing but the shapes.
Rows join (`merge`) and leave (`select`) between decode steps; this is what lets concurrent requests share
one forward pass per step.

All methods run on one worker thread (the server's model executor), so a weight update never overlaps a
forward pass.
"""

from __future__ import annotations

import base64
import glob
import inspect
import io
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open

from miles_lite.engines.reference.lora import LoraAdapters
from miles_lite.engines.reference.routing import RoutingCapture

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class KVBatch:
    """A batch's cache: per layer (keys, values) of shape [B, H_kv, T, D], and `mask` [B, T] (1 = real token)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def seq_lens(self) -> torch.Tensor:
        """Real tokens per row, [B] int64."""
        return self.mask.sum(dim=-1)


@dataclass
class PrefillResult:
    """What a prefill returns: the new rows' cache, next-token logits [B, V] and optional input logprobs."""

    batch: KVBatch
    next_logits: torch.Tensor
    # Per row: None, or SGLang's `input_token_logprobs` values for tokens[start:] (first entry None).
    input_logprobs: list[list[float | None] | None]
    # MoE models: per row, the routed expert ids of its tokens `[len, num_hidden_layers, top_k]` int32.
    routed: list[np.ndarray] | None = None


def parse_dtype(name: str) -> torch.dtype:
    """Map `float32 | bfloat16 | float16` to a torch dtype; raises naming the option."""
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Encode (HF name, tensor) pairs for the reference engine's `/update_weights_from_tensor`.

    The format is base64 of `torch.save(list[(name, cpu tensor)])`; SGLang itself takes
    `MultiprocessingSerializer` handles, which only work inside one machine's CUDA/shared-memory space.
    """
    buf = io.BytesIO()
    torch.save([(str(n), t.detach().cpu().contiguous()) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`; loads with `weights_only=True` (no arbitrary code)."""
    data = torch.load(io.BytesIO(base64.b64decode(payload)), weights_only=True)
    if not isinstance(data, list) or not all(isinstance(x, tuple | list) and len(x) == 2 for x in data):
        raise ValueError("serialized_named_tensors entry must decode to a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in data]


class ReferenceModel:
    """An HF causal LM on CPU with batched prefill/decode over `KVBatch` caches and in-place weight loading."""

    def __init__(self, model_path: str, dtype: str = "float32") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise FileNotFoundError(f"--model-path {model_path!r} has no config.json (expected an HF model directory)")
        self.model_path = model_path
        self.config = AutoConfig.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=parse_dtype(dtype)).eval()
        self.decoder = getattr(self.model, self.model.base_model_prefix)
        self.lm_head = self.model.get_output_embeddings()
        # transformers 5.2x renamed the decoder's `past_key_values` argument to `cache`.
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.vocab_size = int(self.config.vocab_size)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = self._eos_ids()
        # Mixture-of-experts models: which experts each forward routed every token to.
        self.routing = RoutingCapture.attach(self.model, self.config)

        # LoRA adapters by name, applied per batch row (`lora.rows`) on top of the untouched base weights.
        self.lora = LoraAdapters(self.model)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.config, getattr(self.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        return frozenset(ids)

    # ---- forward ---------------------------------------------------------------------------------------------

    def _run(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             past: list[tuple[torch.Tensor, torch.Tensor]] | None) -> tuple[torch.Tensor, list]:
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=past) if past else DynamicCache()
        out = self.decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                           use_cache=True, **{self._cache_kwarg: cache})
        # transformers 5.2x names the output `cache` (reading `past_key_values` warns); older ones do not.
        new_cache = out["cache"] if "cache" in out else out.past_key_values
        return out.last_hidden_state, _cache_tensors(new_cache)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def prefill(self, seqs: list[list[int]], logprob_starts: list[int | None]) -> PrefillResult:
        """Run new sequences (ragged token ids) as one left-padded batch.

        `logprob_starts[i]`: None, or SGLang's `logprob_start_len` for row i (0 <= start < len). Returns the new
        rows' cache, the next-token logits [B, V] (float32) and, per row, input logprobs of tokens[start:].
        """
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("prefill needs at least one non-empty sequence")
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        hidden, kv = self._run(ids, mask, positions, None)
        next_logits = self._logits(hidden[:, -1])
        input_lps: list[list[float | None] | None] = []
        for i, (s, start) in enumerate(zip(seqs, logprob_starts, strict=True)):
            if start is None:
                input_lps.append(None)
                continue
            # Logits at position p score token p+1; SGLang's first entry (token `start`) has no logprob.
            pad = width - len(s)
            span = hidden[i, pad + start: pad + len(s) - 1]
            values: list[float | None] = [None]
            if span.shape[0] > 0:
                logp = torch.log_softmax(self._logits(span), dim=-1)
                targets = torch.tensor(s[start + 1:], dtype=torch.long)
                values += logp.gather(-1, targets[:, None])[:, 0].tolist()
            input_lps.append(values)
        routed = None
        if self.routing is not None:
            ids = self.routing.take(len(seqs), width)
            routed = [ids[i, width - len(s):] for i, s in enumerate(seqs)]
        return PrefillResult(KVBatch(kv, mask), next_logits, input_lps, routed)

    @torch.no_grad()
    def decode(self, batch: KVBatch, tokens: list[int]) -> tuple[KVBatch, torch.Tensor]:
        """Append one token per row; returns the grown batch and next-token logits [B, V] (float32)."""
        if len(tokens) != batch.size:
            raise ValueError(f"decode got {len(tokens)} tokens for a batch of {batch.size}")
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]
        positions = batch.seq_lens[:, None]
        mask = torch.cat([batch.mask, torch.ones(batch.size, 1, dtype=torch.long)], dim=1)
        hidden, kv = self._run(ids, mask, positions, batch.kv)
        self.last_decode_routed = self.routing.take(batch.size, 1)[:, 0] if self.routing is not None else None
        return KVBatch(kv, mask), self._logits(hidden[:, -1])

    @staticmethod
    def select(batch: KVBatch, rows: list[int]) -> KVBatch | None:
        """Keep `rows` (in that order) and drop columns that are padding in every kept row; None if empty."""
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.long)
        mask = batch.mask.index_select(0, index)
        first = int((mask.sum(dim=0) > 0).nonzero()[0].item())
        kv = [(k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:]) for k, v in batch.kv]
        return KVBatch(kv, mask[:, first:].contiguous())

    @staticmethod
    def merge(a: KVBatch | None, b: KVBatch) -> KVBatch:
        """Stack two batches' rows (a first), left-padding the shorter one in time."""
        if a is None:
            return b
        width = max(a.mask.shape[1], b.mask.shape[1])

        def pad(x: torch.Tensor, dim_len: int) -> torch.Tensor:
            missing = width - dim_len
            if missing == 0:
                return x
            shape = list(x.shape)
            shape[-2 if x.dim() == 4 else -1] = missing
            return torch.cat([x.new_zeros(shape), x], dim=-2 if x.dim() == 4 else -1)

        ta, tb = a.mask.shape[1], b.mask.shape[1]
        kv = [(torch.cat([pad(ka, ta), pad(kb, tb)]), torch.cat([pad(va, ta), pad(vb, tb)]))
              for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True)]
        return KVBatch(kv, torch.cat([pad(a.mask, ta), pad(b.mask, tb)]))

    # ---- weights ---------------------------------------------------------------------------------------------

    def named_targets(self) -> dict[str, torch.Tensor]:
        """Every loadable tensor by HF checkpoint name (per-expert names are views into the stacked experts)."""
        # state_dict lists tied weights under both names (same storage), so either HF name loads.
        targets = dict(self.model.state_dict(keep_vars=True))
        # transformers holds a MoE layer's experts stacked (`experts.gate_up_proj` [E, 2F, H], `experts.down_proj`
        # [E, H, F]); checkpoints and weight pushes name each expert's tensors: views into the stacks.
        for name in [n for n in targets if n.endswith(".experts.gate_up_proj")]:
            prefix, stacked = name[: -len("gate_up_proj")], targets[name].data
            down = targets[prefix + "down_proj"].data
            half = stacked.shape[1] // 2
            for e in range(stacked.shape[0]):
                targets[f"{prefix}{e}.gate_proj.weight"] = stacked[e, :half]
                targets[f"{prefix}{e}.up_proj.weight"] = stacked[e, half:]
                targets[f"{prefix}{e}.down_proj.weight"] = down[e]
        return targets

    @torch.no_grad()
    def load_named_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (HF name, tensor) pairs into the model; all names and shapes are checked before any copy.

        Returns the number of tensors loaded. Raises ValueError naming unknown parameters or shape mismatches.
        """
        named = list(named)
        targets = self.named_targets()
        unknown = [n for n, _ in named if n not in targets]
        if unknown:
            raise ValueError(f"unknown parameter names {unknown[:5]} (the model has e.g. {sorted(targets)[:3]})")
        bad = [f"{n}: got {tuple(t.shape)}, expected {tuple(targets[n].shape)}"
               for n, t in named if tuple(t.shape) != tuple(targets[n].shape)]
        if bad:
            raise ValueError(f"shape mismatch: {bad[:5]}")
        for name, tensor in named:
            targets[name].data.copy_(tensor.to(targets[name].dtype))
        return len(named)

    def release_weights(self) -> None:
        """Free every parameter's storage (the shapes are kept for `allocate_weights`)."""
        self._released_shapes = {}
        for name, param in self.model.named_parameters():  # tied weights are one parameter, listed once
            self._released_shapes[name] = tuple(param.shape)
            param.data = torch.empty(0, dtype=param.dtype)

    def allocate_weights(self) -> None:
        """Give every parameter freed by `release_weights` uninitialised storage of its shape again."""
        for name, param in self.model.named_parameters():
            param.data = torch.empty(self._released_shapes[name], dtype=param.dtype)
        self._released_shapes = {}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows (dim 0) of a parameter as float32 nested lists, as SGLang returns."""
        targets = self.named_targets()
        if name not in targets:
            raise ValueError(f"unknown parameter name {name!r}")
        # Slice before converting: a full embedding table to a Python list takes seconds.
        return targets[name].detach()[:truncate_size].float().tolist()


def read_safetensors(model_path: str) -> list[tuple[str, torch.Tensor]]:
    """Every (HF name, tensor) of `model_path/*.safetensors`; raises FileNotFoundError when there are none."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model_path {model_path!r} holds no *.safetensors files")
    named: list[tuple[str, torch.Tensor]] = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            named.extend((key, f.get_tensor(key)) for key in f.keys())
    return named


def _cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer from an HF DynamicCache (layered API of transformers >= 4.56, or the older one)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))
