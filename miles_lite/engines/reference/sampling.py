"""Per-request sampling settings and next-token sampling for the reference engine, matching SGLang 0.5.10.

Logprob semantics (checked against SGLang 0.5.10's `layers/sampler.py` and `layers/logits_processor.py`):

- Output tokens, temperature T > 0: SGLang divides the logits by T, takes the softmax, samples from it (after
  top-k / top-p filtering of a sorted *copy*), and reports `log(softmax(logits / T))[token]`: temperature-scaled,
  but not renormalised by top-k / top-p.
- Output tokens, greedy (T < 1e-6, which SGLang rewrites to T = 1, top_k = 1): `log_softmax(logits)[token]`.
- With the environment variable SGLANG_RETURN_ORIGINAL_LOGPROB=1, SGLang reports the raw `log_softmax(logits)` for
  every request; the reference engine's `--return-original-logprob` flag does the same.
- Input tokens (`logprob_start_len`): raw `log_softmax(logits)` (no temperature), see `model.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from miles_lite.engines.reference import request_fields as rf

# SGLang's `_SAMPLING_EPS`: temperatures below it mean greedy decoding.
SAMPLING_EPS = 1e-6

# SGLang sampling parameters the reference engine accepts only at their default (no-op) value.
_DEFAULT_ONLY: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}
# Accepted and irrelevant without detokenisation or streaming.
_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


@dataclass(frozen=True)
class RequestSampling:
    """One request's `sampling_params`, validated; field names and defaults are SGLang's."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (SGLang: temperature below 1e-6)."""
        return self.temperature < SAMPLING_EPS

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None, vocab_size: int) -> RequestSampling:
        """Validate a `/generate` `sampling_params` object; raises ValueError naming the bad field."""
        if raw is not None and not isinstance(raw, dict):
            raise rf.FieldError(f"sampling_params: expected an object, got {type(raw).__name__}")
        raw = dict(raw or {})
        for key, default in _DEFAULT_ONLY.items():
            value = raw.pop(key, default)
            if value != default:
                raise ValueError(
                    f"sampling_params.{key}={value!r} is not supported by the reference engine; "
                    f"leave it at {default!r} or use the sglang backend"
                )
        for key in _IGNORED:
            raw.pop(key, None)
        known = {"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                 "ignore_eos", "sampling_seed"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"sampling_params has unknown keys {unknown}; known keys: {sorted(known)}")
        stop = raw.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple):
            raise rf.FieldError(f"sampling_params.stop: expected a string or a list of strings, got {stop!r}")
        stop_ids = raw.get("stop_token_ids") or []
        if not isinstance(stop_ids, list | tuple):
            raise rf.FieldError(f"sampling_params.stop_token_ids: expected a list of integers, got {stop_ids!r}")
        params = cls(
            max_new_tokens=rf.integer(raw.get("max_new_tokens", 128), "sampling_params.max_new_tokens"),
            min_new_tokens=rf.integer(raw.get("min_new_tokens", 0), "sampling_params.min_new_tokens"),
            temperature=rf.number(raw.get("temperature", 1.0), "sampling_params.temperature"),
            top_p=rf.number(raw.get("top_p", 1.0), "sampling_params.top_p"),
            top_k=rf.integer(raw.get("top_k", -1), "sampling_params.top_k"),
            stop=tuple(rf.string(s, f"sampling_params.stop[{i}]") for i, s in enumerate(stop)),
            stop_token_ids=frozenset(rf.integer(t, f"sampling_params.stop_token_ids[{i}]")
                                     for i, t in enumerate(stop_ids)),
            ignore_eos=rf.boolean(raw.get("ignore_eos", False), "sampling_params.ignore_eos"),
            sampling_seed=rf.optional_integer(raw.get("sampling_seed"), "sampling_params.sampling_seed"),
        )
        params._verify(vocab_size)
        return params

    def _verify(self, vocab_size: int) -> None:
        # Same ranges as SGLang's SamplingParams.verify.
        if not 0.0 <= self.temperature < math.inf:  # also refuses NaN, which JSON's "NaN" carries
            raise ValueError(f"sampling_params.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling_params.top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sampling_params.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded for one request, or None to use torch's global RNG."""
    if seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def sample_next(
    logits: torch.Tensor,
    params: list[RequestSampling],
    generators: list[torch.Generator | None],
    banned: list[frozenset[int]],
    original_logprob: bool = False,
) -> tuple[list[int], list[float]]:
    """Sample one token per row and return (token ids, logprobs in nats).

    `logits`: [B, V] float32 next-token logits; `params`, `generators`, `banned` have B entries. `banned[i]` are
    token ids masked to -inf first (the stop tokens while a request is below `min_new_tokens`).

    The softmaxes run over the whole batch at once; rows without top-k / top-p draw by inverse CDF from one
    uniform of their own generator, so a decode step costs a few batched ops instead of a dozen per row.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B={len(params)}, V], got {tuple(logits.shape)}")
    logits = logits.float()
    if any(banned):
        logits = logits.clone()
        for i, ban in enumerate(banned):
            if ban:
                logits[i, list(ban)] = float("-inf")
    raw_logp = torch.log_softmax(logits, dim=-1)
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = torch.zeros(len(params), dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    plain = [i for i, p in enumerate(params) if not p.greedy and p.top_k <= 0 and p.top_p >= 1.0]
    filtered = [i for i, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1.0)]
    if greedy:
        tokens[greedy] = torch.argmax(logits[greedy], dim=-1)
    if plain:
        cum = torch.cumsum(logp[plain].exp(), dim=-1)
        uniforms = torch.cat([torch.rand(1, generator=generators[i]) for i in plain])
        # right=True picks the first column whose CDF exceeds u: never a zero-probability token.
        picked = torch.searchsorted(cum, (uniforms * cum[:, -1])[:, None], right=True)[:, 0]
        tokens[plain] = picked.clamp(max=logits.shape[1] - 1)
    for i in filtered:
        p = params[i]
        probs_sort, idx_sort = torch.sort(logp[i].exp(), descending=True)
        if p.top_k > 0:
            probs_sort[p.top_k:] = 0.0
        cum = torch.cumsum(probs_sort, dim=0)
        probs_sort[(cum - probs_sort) > p.top_p] = 0.0
        choice = torch.multinomial(probs_sort, num_samples=1, generator=generators[i])
        tokens[i] = idx_sort[choice]
    reported = raw_logp if original_logprob else logp
    values = reported.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), values.tolist()
