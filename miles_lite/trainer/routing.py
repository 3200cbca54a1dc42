"""MoE routing in the trainer: rollout routing replay and the routing metrics of every step.

Each MoE router of the policy gets a `LayerRouting` in megatron's `router_replay` slot, the hook
megatron's top-k goes through (`topk_routing_with_score_function`). It always records the router's
own top-k; with replay targets set, the tokens that have them take the rollout's experts instead,
and their gates come from the trainer's own scores over those experts (softmax over the k selected
logits, or the full softmax's values at them without `norm_topk_prob`), so the router still learns.

Which tokens replay. A sample carries, per MoE layer, the experts the engine chose at positions
`P .. P + R - 2` of its `P` prompt and `R` response tokens: the generated tokens the engine fed back
through the model while decoding (SGLang's `routed_experts` row `t` is position `t`). Prompt positions
`0 .. P - 1` route with the trainer's router: the engine computed them in a prefill, possibly in
another request's batch or from its prefix cache, and replay is about the tokens the policy
generated. The last response token is never fed to the engine and its output predicts nothing the
loss reads. Padding positions route too (the padded layout), and are left out of the metrics.

Token order is megatron's router order: position-major over a padded `[B, S]` micro-batch
(`s * B + b`), or the packed row's order on the THD path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from miles_lite.trainer.packing import PackedMicroBatch


@dataclass
class LayerRouting:
    """One MoE layer's replay targets for the current micro-batch and what its router did."""

    pre_softmax: bool
    num_experts: int
    target: Tensor | None = None  # [N, k] expert ids (rows without a target hold anything)
    replay: Tensor | None = None  # [N] bool: the token takes `target`
    compare: Tensor | None = None  # [N] bool: the token has a rollout routing (agreement metric)
    valid: Tensor | None = None  # [N] bool: a real token (metrics)
    own: Tensor | None = None  # [N, k] the router's own top-k
    used: Tensor | None = None  # [N, k] the experts the forward used
    probs: Tensor | None = None  # [N, E] full softmax of the router (aux-loss metric)

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None
                        ) -> tuple[Tensor, Tensor]:
        """megatron's `RouterReplay.get_replay_topk` contract: `(gate scores, expert ids)` of each token."""
        assert default_compute_topk is not None
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.own = own.detach()
        with torch.no_grad():
            full = scores.float() if self.pre_softmax else torch.softmax(scores.float(), dim=-1)
            self.probs = full.detach()
        if self.target is None or self.replay is None or not bool(self.replay.any()):
            self.used = self.own
            return values, own
        idx = torch.where(self.replay.to(own.device)[:, None], self.target.to(own.device), own)
        self.used = idx.detach()
        return scores.gather(1, idx), idx


@dataclass
class RoutingStats:
    """Counts summed over a step's micro-batches (then over ranks)."""

    num_layers: int
    num_experts: int
    load: Tensor = field(init=False)  # [L, E] token-slots per expert (experts used)
    prob_mass: Tensor = field(init=False)  # [L, E] summed router probabilities
    tokens: Tensor = field(init=False)  # [L] real tokens
    agree: Tensor = field(init=False)  # [L] token-layers whose own top-k set equals the rollout's
    compared: Tensor = field(init=False)  # [L] token-layers with a rollout routing

    def __post_init__(self) -> None:
        self.load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.prob_mass = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.tokens = torch.zeros(self.num_layers, dtype=torch.float64)
        self.agree = torch.zeros(self.num_layers, dtype=torch.float64)
        self.compared = torch.zeros(self.num_layers, dtype=torch.float64)

    def add(self, i: int, layer: LayerRouting) -> None:
        assert layer.own is not None and layer.used is not None and layer.probs is not None
        valid = layer.valid.to(layer.own.device) if layer.valid is not None else \
            torch.ones(layer.own.shape[0], dtype=torch.bool, device=layer.own.device)
        used = layer.used[valid]
        self.load[i] += torch.bincount(used.reshape(-1).cpu(), minlength=self.num_experts).double()
        self.prob_mass[i] += layer.probs[valid].sum(0).double().cpu()
        self.tokens[i] += float(valid.sum())
        if layer.target is not None and layer.compare is not None:
            has = layer.compare.to(valid.device) & valid
            own = layer.own[has].sort(dim=-1).values
            rollout = layer.target.to(own.device)[has].sort(dim=-1).values
            self.agree[i] += float((own == rollout).all(dim=-1).sum())
            self.compared[i] += float(has.sum())

    def reduce(self) -> None:
        """Sum over every trainer rank (ratios are unchanged by TP ranks counting the same tokens)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        flat = torch.cat([self.load.reshape(-1), self.prob_mass.reshape(-1), self.tokens, self.agree,
                          self.compared])
        dist.all_reduce(flat)
        sizes = [self.load.numel(), self.prob_mass.numel(), self.num_layers, self.num_layers, self.num_layers]
        load, mass, self.tokens, self.agree, self.compared = flat.split(sizes)
        self.load = load.reshape(self.num_layers, self.num_experts)
        self.prob_mass = mass.reshape(self.num_layers, self.num_experts)

    def metrics(self, layer_ids: Sequence[int], top_k: int) -> dict[str, float]:
        """`moe/router_agreement`, per layer `moe/layer{i}/load_max_share` and `moe/layer{i}/load_cv`,
        their means over layers, and `moe/aux_loss` (Switch load-balancing loss; 1.0 when balanced)."""
        out: dict[str, float] = {}
        compared = float(self.compared.sum())
        if compared > 0:
            out["moe/router_agreement"] = float(self.agree.sum()) / compared
        shares, cvs, aux = [], [], []
        for row, layer in enumerate(layer_ids):
            total = float(self.load[row].sum())
            if total == 0:
                continue
            load = self.load[row]
            share = float(load.max()) / total
            cv = float(load.std(unbiased=False) / load.mean())
            f = load / total
            p = self.prob_mass[row] / float(self.tokens[row])
            aux.append(float(self.num_experts * (f * p).sum()))
            out[f"moe/layer{layer}/load_max_share"], out[f"moe/layer{layer}/load_cv"] = share, cv
            shares.append(share)
            cvs.append(cv)
        if shares:
            out["moe/load_max_share"] = float(np.mean(shares))
            out["moe/load_cv"] = float(np.mean(cvs))
            out["moe/aux_loss"] = float(np.mean(aux))
        return out


class ModelRouting:
    """The `LayerRouting` of every MoE router of one model, and the targets of each micro-batch."""

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int], pre_softmax: bool, num_experts: int,
                 top_k: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if len(routers) != len(layer_ids):
            raise RuntimeError(f"the model has {len(routers)} MoE routers, its config {len(layer_ids)} MoE layers")
        self.layer_ids = tuple(layer_ids)
        self.top_k = top_k
        self.num_experts = num_experts
        self.layers = [LayerRouting(pre_softmax, num_experts) for _ in routers]
        for router, layer in zip(routers, self.layers, strict=True):
            router.router_replay = layer

    def new_stats(self) -> RoutingStats:
        return RoutingStats(len(self.layers), self.num_experts)

    def set_micro_batch(self, mb: PackedMicroBatch, routed: Sequence[np.ndarray | None] | None,
                        padded: bool, replay: bool) -> None:
        """Targets (the rollout's experts, kept for the agreement metric; replayed when `replay`) and the
        real-token mask of `mb`, in router order. `routed[i]` belongs to batch sequence i:
        `[R_i - 1, layers, k]` ids or None."""
        rows = [routed[i] if routed is not None else None for i in mb.seq_indices]
        if padded:
            n_rows, width = mb.padded_shape
            base, stride = list(range(len(mb.lengths))), n_rows  # token (b, s) sits at s * B + b
            n = n_rows * width
            valid = torch.zeros(width, n_rows, dtype=torch.bool)
            for b, length in enumerate(mb.lengths):
                valid[:length, b] = True
            valid = valid.reshape(-1)
        else:
            base, stride = mb.cu_seqlens.tolist(), 1
            n = mb.num_tokens
            valid = torch.ones(n, dtype=torch.bool)
        if all(r is None for r in rows):
            for layer in self.layers:
                layer.target, layer.replay, layer.compare, layer.valid = None, None, None, valid
            return
        target = torch.zeros(len(self.layers), n, self.top_k, dtype=torch.long)
        has = torch.zeros(n, dtype=torch.bool)
        for b, (ids, plen) in enumerate(zip(rows, mb.prompt_lengths, strict=True)):
            if ids is None or len(ids) == 0:
                continue
            pos = [base[b] + s * stride for s in range(plen, plen + len(ids))]
            flat = torch.as_tensor(np.asarray(ids, dtype=np.int64))  # [n_b, L, k]
            target[:, pos, :] = flat.permute(1, 0, 2)
            has[pos] = True
        for i, layer in enumerate(self.layers):
            layer.target, layer.valid, layer.compare = target[i], valid, has
            # The agreement metric reads `target` wherever the rollout routed; the forward only when replaying.
            layer.replay = has if replay else torch.zeros_like(has)

    def clear(self) -> None:
        for layer in self.layers:
            layer.target = layer.replay = layer.compare = layer.valid = None
            layer.own = layer.used = layer.probs = None

    def accumulate(self, stats: RoutingStats) -> None:
        for i, layer in enumerate(self.layers):
            if layer.own is not None:
                stats.add(i, layer)


def check_routed(routed: Sequence[np.ndarray | None], response_lengths: Sequence[int], num_layers: int,
                 top_k: int, num_experts: int) -> None:
    """Refuse routed-expert arrays that do not fit the batch or the model, naming the sequence."""
    for i, (ids, r) in enumerate(zip(routed, response_lengths, strict=True)):
        if ids is None:
            continue
        want = (max(r - 1, 0), num_layers, top_k)
        if tuple(ids.shape) != want:
            raise ValueError(f"TrainBatch.routed_experts[{i}] has shape {tuple(ids.shape)}, expected {want} "
                             "(response tokens - 1, MoE layers, experts per token)")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            raise ValueError(f"TrainBatch.routed_experts[{i}] has expert ids outside [0, {num_experts})")


def compact_ids(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert ids in the smallest integer type that holds them (int8 up to 128 experts, else int16)."""
    dtype = np.int8 if num_experts <= 128 else np.int16
    return np.ascontiguousarray(ids, dtype=dtype)

