"""One micro-batch through a `GPTModel` (a THD row on TE, a padded batch on the local spec), to
response-token log-probs and entropies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_lite.trainer.logprobs import LogprobKernels, chunked_logprobs
from miles_lite.trainer.model import HFModelSpec, Runtime
from miles_lite.trainer.packing import PackedMicroBatch, to_device


@dataclass
class ModelHandle:
    """A Megatron model plus what a forward pass needs to know about it.

    Attributes:
        model: the unwrapped `GPTModel` (parameters may be wrapped by DDP elsewhere).
        spec: its HF architecture numbers.
        runtime: device / layer spec / precision.
        padded_vocab: rows of the (padded) output layer, all TP ranks together.
        tp_rank / tp_group: tensor-parallel coordinates (tp_group None when TP = 1).
    """

    model: Any
    spec: HFModelSpec
    runtime: Runtime
    padded_vocab: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None

    @property
    def vocab_start(self) -> int:
        """Global id of this rank's first output-layer row."""
        tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        return self.tp_rank * (self.padded_vocab // tp)

    @property
    def device(self) -> torch.device:
        if self.runtime.device == "gpu":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


# TransformerEngine's FP8 GEMMs need the token dimension divisible by 8 (forward) and by 16 (the
# weight-gradient GEMM, where tokens are the reduction dimension): `assert_dim_for_fp8_exec`.
FP8_TOKEN_MULTIPLE = 16


def fp8_row_padding(runtime: Runtime, num_tokens: int) -> int:
    """Tokens to append to a packed THD row of `num_tokens` so FP8 GEMMs accept it (0 unless fp8)."""
    if runtime.precision != "fp8":
        return 0
    return -num_tokens % FP8_TOKEN_MULTIPLE


def _thd_kwargs(handle: ModelHandle, mb: PackedMicroBatch) -> tuple[Tensor, dict[str, Any]]:
    """Input ids `[1, T(+pad)]` and GPTModel keyword arguments of a packed THD row (TE spec)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    dev = handle.device
    tokens = to_device(mb.tokens, dev)
    cu = to_device(mb.cu_seqlens, dev)
    max_len = max(mb.lengths)
    positions = to_device(mb.position_ids, dev)
    pad = fp8_row_padding(handle.runtime, mb.num_tokens)
    if pad:
        # A trailing dummy sequence of `pad` tokens: attended only by itself, never read back.
        tokens = torch.cat([tokens, tokens.new_zeros(1, pad)], dim=1)
        positions = torch.cat([positions, torch.arange(pad, device=dev)[None]], dim=1)
        cu = torch.cat([cu, cu[-1:] + pad])
        max_len = max(max_len, pad)
    return tokens, dict(
        position_ids=positions,
        attention_mask=None,
        packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                          max_seqlen_q=max_len, max_seqlen_kv=max_len),
    )


def _decoder_output(handle: ModelHandle, tokens: Tensor, **kwargs: Any) -> Tensor:
    """Final hidden states `[S, B, H]` (after the final norm, before the output layer)."""
    # GPTModel has no "hidden states only" call; with post_process off its forward stops right
    # before the output layer, which we then apply chunk by chunk (see logprobs.py).
    model = handle.model
    saved = model.post_process
    model.post_process = False
    try:
        return model(input_ids=tokens, **kwargs)
    finally:
        model.post_process = saved


def _mrope(positions: Tensor) -> Tensor:
    # Multimodal-RoPE position layout [3, b, s] with identical rows = 1-D RoPE at these positions.
    return positions.unsqueeze(0).expand(3, -1, -1)


def padded_hidden_states(handle: ModelHandle, mb: PackedMicroBatch) -> Tensor:
    """Final hidden states `[T, H]` in packed order, computed as a right-padded `[B, S]` batch (local spec).

    A causal mask alone is exact here: with right padding, a real token's keys (itself and what
    precedes it) are all real, so no real position ever attends padding, and padding positions,
    never read back, get no gradient.
    """
    dev = handle.device
    tokens, positions, valid = mb.padded_layout()
    width = tokens.shape[1]
    causal = ~torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None, None]
    hidden = _decoder_output(handle, to_device(tokens, dev), position_ids=_mrope(to_device(positions, dev)),
                             attention_mask=causal)
    return hidden.transpose(0, 1)[to_device(valid, dev)]  # [S, B, H] -> [T, H]


def packed_row_hidden_states(handle: ModelHandle, mb: PackedMicroBatch) -> Tensor:
    """Final hidden states `[T, H]` of one packed row under a `[T, T]` block-diagonal causal mask (local spec).

    Not the training path (attention over all T^2 pairs): the reference layout the padded one is
    tested and benchmarked against.
    """
    dev = handle.device
    hidden = _decoder_output(handle, mb.tokens.to(dev), position_ids=_mrope(mb.position_ids.to(dev)),
                             attention_mask=mb.attention_mask().to(dev))
    return hidden[:, 0, :]


def _hidden_states(handle: ModelHandle, mb: PackedMicroBatch) -> Tensor:
    """Final hidden states `[T, H]` of a micro-batch, in packed order (THD row on TE, padded batch on local)."""
    if not handle.runtime.packed_thd:
        return padded_hidden_states(handle, mb)
    tokens, kwargs = _thd_kwargs(handle, mb)
    return _decoder_output(handle, tokens, **kwargs)[: mb.num_tokens, 0, :]  # [T(+pad), 1, H] -> [T, H]


@dataclass(frozen=True)
class LogprobOptions:
    """How log-probs are computed from hidden states (the `trainer.logprob_*` settings)."""

    chunk_tokens: int
    recompute: bool
    kernels: LogprobKernels

    @staticmethod
    def of(trainer: Any) -> LogprobOptions:
        """From a `TrainerConfig`."""
        return LogprobOptions(trainer.logprob_chunk_tokens, trainer.logprob_recompute,
                              LogprobKernels(trainer.logprob_kernel))


def response_logprobs(
    handle: ModelHandle, mb: PackedMicroBatch, opts: LogprobOptions, with_entropy: bool, real_vocab: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of every response token of a packed micro-batch.

    Args:
        handle: the model to run.
        mb: the packed micro-batch.
        opts: chunking, recomputation and kernels.
        with_entropy: also compute the per-token entropy of the policy.
        real_vocab: vocabulary columns in the softmax (default: the model's HF vocabulary).

    Returns:
        `(logp [R], entropy [R] or None)`, fp32 nats, R = sum of response lengths in sequence order;
        differentiable when grad is enabled.
    """
    hidden = _hidden_states(handle, mb)
    logit_pos, targets = mb.response_positions()
    picked = hidden.index_select(0, to_device(logit_pos, hidden.device))
    model = handle.model
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None

    def project(h: Tensor) -> Tensor:
        logits, _ = model.output_layer(h.unsqueeze(1), weight=weight)
        return logits[:, 0, :]

    vocab = handle.spec.vocab_size if real_vocab is None else real_vocab
    return chunked_logprobs(picked, to_device(targets, hidden.device), project, handle.vocab_start, vocab,
                            handle.tp_group, opts.chunk_tokens, with_entropy, recompute=opts.recompute,
                            kernels=opts.kernels)
