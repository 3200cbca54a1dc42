"""The reshard plan: which slice of which trainer shard lands where in which engine rank's shard.

Pure: metadata in, transfer lists out; no tensors move here except in `apply_plan`, the
reference reassembly that tests (and the in-process transports) use.

Coordinates. Every parameter is described per HF tensor (`ParamSpec`). A transfer copies a
contiguous block along one dimension (`dim`, all other dimensions whole) from a trainer rank's
local shard of the *source* tensor (the Megatron parameter that holds it) into an engine rank's
local shard of the HF tensor.

Trainer side (Megatron-core conventions, TP = `trainer_tp`):
- column (dim 0) and row (dim 1) parallel tensors: rank r holds block r of n/tp.
- qkv: q/k/v live in one fused `linear_qkv` tensor, interleaved per query group: for each of the
  G = num_kv_heads groups, [q heads of the group (num_heads/G * head_dim rows), k (head_dim), v (head_dim)].
  Rank r holds groups [r*G/tp, (r+1)*G/tp) (Megatron requires tp | G).
- gate_up: `linear_fc1` local shard = [gate block r; up block r], each ffn/tp rows.
- vocab: rows padded to `trainer_padded_vocab` (a multiple of tp); rank r holds padded rows
  [r*Vp/tp, (r+1)*Vp/tp); rows >= the real vocab are padding and never sent.
- replicated (norms, row-parallel biases): every rank holds the whole tensor; rank 0 is the source.
- routed experts (MoE, expert TP 1): whole on the expert-parallel rank that holds them (`holder`, a
  sender index): fc1 = [gate; up], fc2 = down, no TP split. Their kind describes the engine side:
  gate_up (gate and up split on dim 0) and row (down split on dim 1), as SGLang's TP MoE shards w13/w2.

Senders. A transfer's `src_rank` indexes the trainer's *senders*: 0..tp-1 are the TP ranks of
data-parallel rank 0 (dense parameters are split over them); with expert parallelism, experts whose EP
rank is not among them come from further senders (index >= tp), one per such EP rank. The shards a
transport is handed, and the group ranks of the shard mode, follow the same index (`sender_count`).

Engine side (SGLang 0.5.10 conventions for Qwen2/Llama, TP = engine tp):
- QKVParallelLinear: q heads split evenly; KV heads split when tp <= num_kv_heads, otherwise
  REPLICATED: each rank holds one KV head, index rank // (tp // num_kv_heads)
  (`linear.py`: num_kv_head_replicas, shard_id = tp_rank // num_kv_head_replicas).
- MergedColumnParallelLinear (gate_up_proj) and ColumnParallelLinear: dim 0 split evenly per HF tensor.
- RowParallelLinear (o_proj, down_proj): dim 1 split evenly.
- VocabParallelEmbedding / ParallelLMHead: vocab padded to a multiple of `vocab_pad_to` (64),
  split on dim 0; rank r's shard has Vp/tp rows, its real rows first, padding rows zero.
- norms: replicated.
The destination of a transfer is in coordinates of the engine rank's local shard *of the HF
tensor* (e.g. rank r's q rows of q_proj); where SGLang places that inside its fused parameters is
`fused_offset` (q at 0, k after the rank's q rows, v after k; gate at 0, up after gate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

KINDS = ("replicated", "column", "row", "qkv", "gate_up", "vocab")
QKV_ROLES = ("q", "k", "v")
GATE_UP_ROLES = ("gate", "up")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class PlanError(ValueError):
    """Parameter metadata or parallel sizes that no valid plan can serve."""


@dataclass(frozen=True)
class ParamSpec:
    """One HF tensor and how the trainer and the engines shard it.

    - `name`: HF name (`model.layers.0.self_attn.q_proj.weight`).
    - `shape`: full HF shape (unpadded, unsharded), in elements.
    - `dtype`: dtype sent to the engines (`bfloat16`, `float32`, ...).
    - `kind`: replicated | column | row | qkv | gate_up | vocab.
    - `source`: name of the trainer tensor holding it (the fused Megatron parameter for qkv/gate_up);
      defaults to `name`.
    - `role`: q | k | v for qkv, gate | up for gate_up.
    - `num_heads`, `num_kv_heads`, `head_dim`: attention geometry (qkv only).
    - `trainer_padded_vocab`: rows of the trainer's vocab tensor (vocab only; 0 = no padding).
    - `holder`: the sender holding the whole tensor (routed experts: kind gate_up or row, never split by the
      trainer's TP); -1 for tensors split over (or replicated on) the TP senders 0..tp-1.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    kind: str = "replicated"
    source: str = ""
    role: str = ""
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    trainer_padded_vocab: int = 0
    holder: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.source:
            object.__setattr__(self, "source", self.name)
        where = f"ParamSpec {self.name!r}"
        if self.kind not in KINDS:
            raise PlanError(f"{where}: kind={self.kind!r}; use one of {KINDS}")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"{where}: dtype={self.dtype!r}; use one of {tuple(DTYPE_BYTES)}")
        if not self.shape or any(s <= 0 for s in self.shape):
            raise PlanError(f"{where}: shape={self.shape} must be non-empty with positive sizes")
        if self.kind == "row" and len(self.shape) < 2:
            raise PlanError(f"{where}: row-parallel splits dim 1 but shape={self.shape}; use kind='replicated'")
        if self.kind == "qkv":
            if self.role not in QKV_ROLES:
                raise PlanError(f"{where}: role={self.role!r}; a qkv tensor needs role in {QKV_ROLES}")
            if min(self.num_heads, self.num_kv_heads, self.head_dim) <= 0 or self.num_heads % self.num_kv_heads:
                raise PlanError(
                    f"{where}: num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim} "
                    "must be positive with num_kv_heads dividing num_heads"
                )
            heads = self.num_heads if self.role == "q" else self.num_kv_heads
            if self.shape[0] != heads * self.head_dim:
                raise PlanError(f"{where}: shape[0]={self.shape[0]} but {self.role} needs {heads}*{self.head_dim} rows")
        if self.kind == "gate_up" and self.role not in GATE_UP_ROLES:
            raise PlanError(f"{where}: role={self.role!r}; a gate_up tensor needs role in {GATE_UP_ROLES}")
        if self.kind == "vocab" and self.trainer_padded_vocab and self.trainer_padded_vocab < self.shape[0]:
            raise PlanError(f"{where}: trainer_padded_vocab={self.trainer_padded_vocab} < vocab {self.shape[0]}")
        if self.holder >= 0 and self.kind not in ("gate_up", "row"):
            raise PlanError(f"{where}: holder={self.holder} marks a whole expert tensor, but kind={self.kind!r}; "
                            "only gate_up (fc1) and row (fc2) tensors are held whole by one sender")

    @property
    def dim(self) -> int:
        """The partition dimension (0 for every split kind but row)."""
        return 1 if self.kind == "row" else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along `dim` (product of the other dimensions times the element size)."""
        other = math.prod(s for i, s in enumerate(self.shape) if i != self.dim)
        return other * DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the full HF tensor in `dtype`."""
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the fleet: its id, its tensor-parallel size, its vocab padding multiple."""

    engine_id: str
    tp: int
    vocab_pad_to: int = 64

    def __post_init__(self) -> None:
        if self.tp <= 0 or self.vocab_pad_to <= 0:
            raise PlanError(f"EngineSpec {self.engine_id!r}: tp={self.tp} and vocab_pad_to={self.vocab_pad_to} "
                            "must both be > 0")


@dataclass(frozen=True)
class Transfer:
    """Copy `length` indices along `dim`: trainer rank `src_rank`'s local `source` tensor from
    `src_start`, into the engine rank's local shard of HF tensor `name` from `dst_start`."""

    name: str
    source: str
    src_rank: int
    dim: int
    src_start: int
    dst_start: int
    length: int
    nbytes: int

    def src_index(self, ndim: int) -> tuple[slice, ...]:
        """Index tuple selecting the block in the source tensor (ndim = its number of dimensions)."""
        return _block(ndim, self.dim, self.src_start, self.length)

    def dst_index(self, ndim: int) -> tuple[slice, ...]:
        """Index tuple selecting the block in the destination shard."""
        return _block(ndim, self.dim, self.dst_start, self.length)


@dataclass(frozen=True)
class ShardPlan:
    """One HF tensor's local shard on one engine rank: its shape and the transfers that fill it.

    Rows not covered by any transfer (vocab padding) are zero.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    transfers: tuple[Transfer, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class RankPlan:
    """Everything one engine rank (of an engine with TP `tp`) receives, in model order; each transfer
    names the trainer rank that sends it."""

    tp: int
    rank: int
    shards: tuple[ShardPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


@dataclass(frozen=True)
class ReshardPlan:
    """Per engine (fleet order), per engine TP rank, the shards to build."""

    trainer_tp: int
    engines: tuple[EngineSpec, ...]
    ranks: tuple[tuple[RankPlan, ...], ...]
    senders: int = 0

    def __post_init__(self) -> None:
        if not self.senders:
            object.__setattr__(self, "senders", self.trainer_tp)


def _block(ndim: int, dim: int, start: int, length: int) -> tuple[slice, ...]:
    return tuple(slice(start, start + length) if i == dim else slice(None) for i in range(ndim))


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise PlanError(f"{what}: size {n} is not divisible by tp={tp}; choose a tp that divides it")
    return n // tp


# Segments: (full_start, full_stop, rank, local_start) along the partition dim.
Segment = tuple[int, int, int, int]


def trainer_segments(spec: ParamSpec, tp: int) -> list[Segment]:
    """Where each block of the full HF tensor sits in the trainer's local source shards (Megatron layout)."""
    n = spec.shape[spec.dim]
    where = f"{spec.name} (trainer tp={tp})"
    if spec.holder >= 0:  # a routed expert, whole on one sender: [gate; up] (dim 0) or down (dim 1)
        return [(0, n, spec.holder, n if spec.role == "up" else 0)]
    if spec.kind == "replicated":
        return [(0, n, 0, 0)]
    if spec.kind in ("column", "row"):
        per = _split(n, tp, where)
        return [(r * per, (r + 1) * per, r, 0) for r in range(tp)]
    if spec.kind == "gate_up":
        per = _split(n, tp, where)
        offset = 0 if spec.role == "gate" else per
        return [(r * per, (r + 1) * per, r, offset) for r in range(tp)]
    if spec.kind == "vocab":
        padded = spec.trainer_padded_vocab or n
        per = _split(padded, tp, f"{where} padded vocab")
        return [(r * per, min((r + 1) * per, n), r, 0) for r in range(tp) if r * per < n]
    # qkv: Megatron's fused tensor, interleaved per query group.
    groups, hd = spec.num_kv_heads, spec.head_dim
    per_group_q = spec.num_heads // groups
    groups_per_rank = _split(groups, tp, f"{where} query groups")
    block = (per_group_q + 2) * hd
    inner = {"q": 0, "k": per_group_q * hd, "v": (per_group_q + 1) * hd}[spec.role]
    rows = per_group_q * hd if spec.role == "q" else hd
    segments = []
    for g in range(groups):
        rank, local_group = divmod(g, groups_per_rank)
        segments.append((g * rows, (g + 1) * rows, rank, local_group * block + inner))
    return segments


def source_shape(specs: Sequence[ParamSpec], tp: int) -> tuple[int, ...]:
    """Local shape of one trainer source tensor on every rank, from the specs it holds (all share `source`)."""
    first = specs[0]
    shape = list(first.shape)
    if first.holder >= 0:
        shape[0] = sum(s.shape[0] for s in specs)
        return tuple(shape)
    if first.kind == "replicated":
        return tuple(shape)
    if first.kind == "qkv":
        shape[0] = first.num_kv_heads // tp * (first.num_heads // first.num_kv_heads + 2) * first.head_dim
    elif first.kind == "gate_up":
        shape[0] = sum(s.shape[0] for s in specs) // tp
    elif first.kind == "vocab":
        shape[0] = (first.trainer_padded_vocab or first.shape[0]) // tp
    else:
        shape[first.dim] //= tp
    return tuple(shape)


def engine_segments(spec: ParamSpec, engine: EngineSpec, rank: int) -> tuple[list[Segment], int]:
    """Blocks of the full HF tensor held by engine rank `rank` (SGLang layout), and the local size along `dim`."""
    tp, n = engine.tp, spec.shape[spec.dim]
    where = f"{spec.name} (engine {engine.engine_id!r} tp={tp})"
    if spec.kind == "replicated":
        return [(0, n, rank, 0)], n
    if spec.kind in ("column", "row", "gate_up"):
        per = _split(n, tp, where)
        return [(rank * per, (rank + 1) * per, rank, 0)], per
    if spec.kind == "vocab":
        padded = -(-n // engine.vocab_pad_to) * engine.vocab_pad_to
        per = _split(padded, tp, f"{where} padded vocab {padded}")
        start, stop = rank * per, min((rank + 1) * per, n)
        return ([(start, stop, rank, 0)] if start < stop else []), per
    hd = spec.head_dim
    if spec.role == "q":
        heads = _split(spec.num_heads, tp, f"{where} attention heads")
        return [(rank * heads * hd, (rank + 1) * heads * hd, rank, 0)], heads * hd
    kv = spec.num_kv_heads
    if tp >= kv:
        replicas = _split(tp, kv, f"{where} KV-head replicas (tp must be a multiple of num_kv_heads)")
        head = rank // replicas
        return [(head * hd, (head + 1) * hd, rank, 0)], hd
    heads = _split(kv, tp, f"{where} KV heads")
    return [(rank * heads * hd, (rank + 1) * heads * hd, rank, 0)], heads * hd


def fused_offset(spec: ParamSpec, tp: int) -> int:
    """Offset along dim 0 of this HF tensor's local shard inside SGLang's fused parameter
    (qkv_proj: q, then k, then v; gate_up_proj: gate, then up); 0 for unfused tensors."""
    if spec.kind == "qkv":
        q_rows = spec.num_heads // tp * spec.head_dim
        kv_rows = max(spec.num_kv_heads // tp, 1) * spec.head_dim
        return {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[spec.role]
    if spec.kind == "gate_up" and spec.role == "up":
        return spec.shape[0] // tp
    return 0


def _rank_plan(specs: Sequence[ParamSpec], trainer_tp: int, engine: EngineSpec, rank: int) -> RankPlan:
    shards = []
    for spec in specs:
        src_segments = trainer_segments(spec, trainer_tp)
        dst_segments, local = engine_segments(spec, engine, rank)
        transfers = []
        for d_start, d_stop, _, d_local in dst_segments:
            for s_start, s_stop, s_rank, s_local in src_segments:
                lo, hi = max(d_start, s_start), min(d_stop, s_stop)
                if lo >= hi:
                    continue
                nbytes = (hi - lo) * spec.row_bytes
                transfers.append(Transfer(spec.name, spec.source, s_rank, spec.dim, s_local + lo - s_start,
                                          d_local + lo - d_start, hi - lo, nbytes))
        shape = list(spec.shape)
        shape[spec.dim] = local
        shards.append(ShardPlan(spec.name, tuple(shape), spec.dtype, tuple(transfers)))
    return RankPlan(engine.tp, rank, tuple(shards))


def sender_count(specs: Sequence[ParamSpec], trainer_tp: int) -> int:
    """How many trainer senders the plan reads from: the TP ranks, and the holders of experts beyond them."""
    return max([trainer_tp, *(s.holder + 1 for s in specs)])


def _by_source(specs: Sequence[ParamSpec]) -> dict[tuple[str, int], list[ParamSpec]]:
    """Specs per trainer tensor: (source name, holder); the same Megatron name on two EP ranks holds two
    different experts (the name carries the local index)."""
    by_source: dict[tuple[str, int], list[ParamSpec]] = {}
    for s in specs:
        by_source.setdefault((s.source, s.holder), []).append(s)
    return by_source


def _check_specs(specs: Sequence[ParamSpec], trainer_tp: int) -> None:
    if trainer_tp <= 0:
        raise PlanError(f"trainer_tp={trainer_tp} must be > 0")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise PlanError(f"duplicate ParamSpec names {dup}; each HF tensor appears once")
    for (source, holder), group in _by_source(specs).items():
        kinds = {s.kind for s in group}
        if len(kinds) > 1:
            raise PlanError(f"trainer tensor {source!r} (holder {holder}) holds specs of kinds {sorted(kinds)}; a "
                            "source has one kind")
        roles = [s.role for s in group]
        if len(group) > 1 and (len(set(roles)) != len(roles) or group[0].kind not in ("qkv", "gate_up")):
            raise PlanError(f"trainer tensor {source!r} is shared by {[s.name for s in group]}; only distinct q/k/v "
                            "or gate/up roles may share a source")


def build_plan(specs: Sequence[ParamSpec], trainer_tp: int, engines: Sequence[EngineSpec]) -> ReshardPlan:
    """The transfers that build every engine rank's shards from `trainer_tp` Megatron shards.

    Engines of equal TP get equal rank plans (computed once). Shards follow `specs` order.
    """
    _check_specs(specs, trainer_tp)
    ids = [e.engine_id for e in engines]
    if len(set(ids)) != len(ids):
        raise PlanError(f"duplicate engine ids {ids}")
    cache: dict[tuple[int, int], tuple[RankPlan, ...]] = {}
    ranks = []
    for engine in engines:
        key = (engine.tp, engine.vocab_pad_to)
        if key not in cache:
            cache[key] = tuple(_rank_plan(specs, trainer_tp, engine, r) for r in range(engine.tp))
        ranks.append(cache[key])
    return ReshardPlan(trainer_tp, tuple(engines), tuple(ranks), sender_count(specs, trainer_tp))


def full_tensor_plan(specs: Sequence[ParamSpec], trainer_tp: int) -> RankPlan:
    """Transfers that rebuild the full, unpadded HF tensors (SGLang's broadcast path and the disk path)."""
    _check_specs(specs, trainer_tp)
    return _rank_plan(specs, trainer_tp, EngineSpec("full", tp=1, vocab_pad_to=1), 0)


def source_shapes(specs: Sequence[ParamSpec], trainer_tp: int, sender: int = 0) -> dict[str, tuple[int, ...]]:
    """Local shape of every trainer source tensor sender `sender` must provide (its `named_shards`): the TP
    senders' share of the split and replicated tensors, and the whole expert tensors it holds."""
    return {source: source_shape(group, trainer_tp) for (source, holder), group in _by_source(specs).items()
            if holder == sender or (holder < 0 and sender < trainer_tp)}


def apply_rank_plan(rank_plan: RankPlan, trainer_shards: Sequence[Mapping[str, torch.Tensor]],
                    names: Sequence[str] | None = None, device: torch.device | str | None = None
                    ) -> dict[str, torch.Tensor]:
    """Assemble one engine rank's shards; `trainer_shards[r][source]` is trainer rank r's local tensor.

    `names` restricts to those HF tensors (a bucket), in plan order; `device` defaults to the source's.
    Returns HF name -> tensor of the shard's shape and dtype (padding rows zero).
    """
    wanted = None if names is None else set(names)
    out = {}
    for shard in rank_plan.shards:
        if wanted is not None and shard.name not in wanted:
            continue
        dtype = getattr(torch, shard.dtype)
        where = device
        if where is None and shard.transfers:
            first = shard.transfers[0]
            where = _source(trainer_shards, first).device
        dst = torch.zeros(shard.shape, dtype=dtype, device=where)
        for t in shard.transfers:
            src = _source(trainer_shards, t)
            dst[t.dst_index(dst.dim())] = src[t.src_index(src.dim())].to(device=dst.device, dtype=dtype)
        out[shard.name] = dst
    if wanted is not None and len(out) != len(wanted):
        raise PlanError(f"names {sorted(wanted - out.keys())} are not in the plan")
    return out


def _source(trainer_shards: Sequence[Mapping[str, torch.Tensor]], t: Transfer) -> torch.Tensor:
    if t.src_rank >= len(trainer_shards) or t.source not in trainer_shards[t.src_rank]:
        raise PlanError(f"trainer rank {t.src_rank} has no tensor {t.source!r} (needed for {t.name}); "
                        "named_shards must hold every Megatron parameter of every TP rank")
    return trainer_shards[t.src_rank][t.source]


def apply_plan(plan: ReshardPlan, trainer_shards: Sequence[Mapping[str, torch.Tensor]]
               ) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Every engine's per-rank shards: engine id -> [rank 0 shards, rank 1 shards, ...]."""
    if len(trainer_shards) != plan.senders:
        raise PlanError(f"apply_plan got {len(trainer_shards)} trainer shards for {plan.senders} senders "
                        f"(trainer_tp={plan.trainer_tp} and the holders of routed experts)")
    return {engine.engine_id: [apply_rank_plan(rp, trainer_shards) for rp in ranks]
            for engine, ranks in zip(plan.engines, plan.ranks, strict=True)}
