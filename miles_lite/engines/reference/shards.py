"""The reference engine's TP-sharded weights: one SGLang-laid-out store per TP rank, and the model they make.

The engine's `ParamSpec`s come from its HF parameters (q/k/v -> fused qkv, gate/up -> fused gate_up,
o_proj/down_proj row-parallel, embeddings/LM head vocab-parallel, everything else replicated). Every
weight update lands in the rank stores first: received shards are placed as they are, full tensors
(disk, serialized tensors) are sliced per rank the way SGLang's loaders do; the updated HF tensors are
then re-assembled from the stores and copied into the model the engine computes with. Pushes through
the weight-loader plugin write a rank's store in place (`RankParameters` is the plugin's view of it,
as SGLang's model is in an SGLang worker); `commit` then brings the model up to date.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from miles_lite.engines.reference.model import ReferenceModel
from miles_lite.weight_sync.engine_layout import Store, assemble, make_stores, place_shard, shard_full
from miles_lite.weight_sync.plan import EngineSpec, ParamSpec

_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_GATE_UP = {"gate_proj": "gate", "up_proj": "up"}
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")

Shards = list[tuple[str, torch.Tensor]]


def engine_specs(model: ReferenceModel) -> list[ParamSpec]:
    """One `ParamSpec` per HF parameter of the model (tied weights once), sharded as SGLang shards them."""
    cfg = model.config
    heads, kv = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    dtype = str(next(model.model.parameters()).dtype).removeprefix("torch.")
    specs = []
    targets = model.named_targets()
    names = [n for n, _ in model.model.named_parameters() if not n.endswith((".experts.gate_up_proj",
                                                                              ".experts.down_proj"))]
    # MoE: one expert's gate/up/down under the checkpoint's names (views into transformers' stacked
    # experts), sharded per expert as SGLang's tensor-parallel MoE shards them.
    names += [n for n in targets if ".mlp.experts." in n and n.endswith("_proj.weight")]
    for name in names:
        param = targets[name]
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        shape = tuple(param.shape)
        if module in _QKV:
            specs.append(ParamSpec(name, shape, dtype, "qkv", role=_QKV[module], num_heads=heads, num_kv_heads=kv,
                                   head_dim=head_dim))
        elif module in _GATE_UP:
            specs.append(ParamSpec(name, shape, dtype, "gate_up", role=_GATE_UP[module],
                                   source=name.replace(module, "gate_up_proj")))
        elif module in _ROW and parts[-1] == "weight":
            specs.append(ParamSpec(name, shape, dtype, "row"))
        elif module in _VOCAB:
            specs.append(ParamSpec(name, shape, dtype, "vocab"))
        else:
            specs.append(ParamSpec(name, shape, dtype, "replicated"))
    return specs


class RankParameters:
    """One rank's store seen as a model: `named_parameters()` in SGLang's names and layout (what the
    weight-loader plugin writes into), and the object the plugin keeps its group membership on."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.store.items())


class ShardedWeights:
    """The rank stores of one engine (TP `engine.tp`) over a `ReferenceModel`; call on the model thread."""

    def __init__(self, model: ReferenceModel, tp: int) -> None:
        self.model = model
        # HF shapes, no vocab padding: what the trainer's plan targets for reference engines.
        self.engine = EngineSpec("reference", tp, vocab_pad_to=1)
        self.specs = engine_specs(model)
        self.by_name = {s.name: s for s in self.specs}
        targets = model.named_targets()
        self.stores: list[Store] = make_stores(self.specs, {s.name: targets[s.name].detach() for s in self.specs},
                                               self.engine)

    def _spec(self, name: str) -> ParamSpec:
        # Tied weights are one parameter listed under both names; either name updates it.
        spec = self.by_name.get(name) or self.by_name.get(self._tied.get(name, ""))
        if spec is None:
            raise ValueError(f"unknown parameter name {name!r} (the model has e.g. {list(self.by_name)[:3]})")
        return spec

    @property
    def _tied(self) -> dict[str, str]:
        if not getattr(self.model.config, "tie_word_embeddings", False):
            return {}
        return {"lm_head.weight": "model.embed_tokens.weight", "model.embed_tokens.weight": "lm_head.weight"}

    def _commit(self, names: list[str]) -> int:
        """Copy the re-assembled HF tensors of `names` into the model; the number of tensors loaded."""
        full = assemble(self.specs, self.stores, self.engine, dict.fromkeys(names))
        return self.model.load_named_tensors(list(full.items()))

    def release(self, keep_host_copy: bool) -> None:
        """Free the model the engine computes with. `keep_host_copy` (SGLang's --enable-weights-cpu-backup):
        the rank stores keep the weights and a resume restores them. Without it SGLang's memory saver drops
        the released bytes, so the stores are zeroed: after a resume the engine computes with zeros until a
        weight update refills them, and a push that leaves some tensors out fails its verification here as
        it would on SGLang."""
        self.model.release_weights()
        if not keep_host_copy:
            for store in self.stores:
                for tensor in store.values():
                    tensor.zero_()

    def resume(self) -> int:
        """Re-allocate the model released by `release` and fill it from the rank stores; tensors loaded."""
        self.model.allocate_weights()
        return self._commit([s.name for s in self.specs])

    def load_rank_shards(self, per_rank: Sequence[Shards]) -> int:
        """Place each rank's received local shards (`per_rank[r]`) into its store, then update the model."""
        if len(per_rank) != self.engine.tp:
            raise ValueError(f"got shards of {len(per_rank)} ranks for an engine with tp={self.engine.tp}")
        names: list[str] = []
        for rank, shards in enumerate(per_rank):
            for name, tensor in shards:
                spec = self._spec(name)
                place_shard(self.stores[rank], spec, self.engine, tensor)
                names.append(spec.name)
        return self._commit(names)

    def commit(self, names: Sequence[str]) -> int:
        """Bring the model up to date with the stores for HF tensors `names` (written in place by the plugin)."""
        return self._commit([self._spec(name).name for name in dict.fromkeys(names)])

    def load_full(self, named: Shards) -> int:
        """Slice full HF tensors into every rank's store (as each TP rank's loader would), then update the model."""
        return self.load_full_per_rank([named] * self.engine.tp)

    def load_full_per_rank(self, per_rank: Sequence[Shards]) -> int:
        """Rank r slices its own shards from the full HF tensors `per_rank[r]`; then the model is updated.

        All names and shapes are checked before any store changes.
        """
        if len(per_rank) != self.engine.tp:
            raise ValueError(f"got tensors for {len(per_rank)} ranks; this engine has tp={self.engine.tp}")
        checked = []
        for rank, named in enumerate(per_rank):
            for name, tensor in named:
                spec = self._spec(name)
                if tuple(tensor.shape) != spec.shape:
                    raise ValueError(f"shape mismatch: {name}: got {tuple(tensor.shape)}, expected {spec.shape}")
                checked.append((rank, spec, tensor))
        for rank, spec, tensor in checked:
            place_shard(self.stores[rank], spec, self.engine, shard_full(spec, tensor, self.engine, rank))
        return self._commit([spec.name for _, spec, _ in checked])
