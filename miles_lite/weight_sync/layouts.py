"""Adapter: the trainer's `ParamLayout`s (one per Megatron parameter) -> the plan's `ParamSpec`s (one per HF tensor).

The trainer shards handed to a transport are then `{megatron_name: local tensor}` per sender (the TP ranks,
then the holders of routed experts: `plan` module docstring), since every spec's `source` is the Megatron
parameter name. A routed expert's spec names the sender holding it (`holder`), because its Megatron name
carries the expert's local index and means another expert on another expert-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from miles_lite.trainer.layout import LayoutKind, ParamLayout
from miles_lite.weight_sync.plan import GATE_UP_ROLES, QKV_ROLES, ParamSpec

_KIND = {
    LayoutKind.REPLICATED: "replicated",
    LayoutKind.COLUMN_PARALLEL: "column",
    LayoutKind.ROW_PARALLEL: "row",
    LayoutKind.QKV_FUSED: "qkv",
    LayoutKind.GATE_UP_FUSED: "gate_up",
    LayoutKind.VOCAB_PADDED: "vocab",
}


def specs_from_layouts(layouts: Iterable[ParamLayout], dtype: str,
                       expert_senders: Mapping[int, int] | None = None) -> list[ParamSpec]:
    """One `ParamSpec` per HF tensor, in parameter order; `dtype` is what the engines receive.

    `layouts` covers every routed expert (one layout per global expert, whichever EP rank holds it) and
    `expert_senders` maps a global expert to the sender holding it; None: sender 0 holds every expert
    (expert parallelism 1, where each TP rank holds all experts whole).

    An HF tensor reachable from two Megatron parameters (never in one model: the local and TE
    specs name the same norm differently) is kept once, from its first parameter.
    """
    specs: list[ParamSpec] = []
    seen: set[str] = set()
    for layout in layouts:
        kind = _KIND[layout.kind]
        roles: tuple[str, ...] = ("",) * len(layout.hf_names)
        if kind == "qkv":
            roles = QKV_ROLES
        elif kind == "gate_up":
            roles = GATE_UP_ROLES
        holder = -1
        if layout.expert is not None:
            if expert_senders is None:
                holder = 0
            elif layout.expert in expert_senders:
                holder = expert_senders[layout.expert]
            else:
                raise ValueError(f"routed expert {layout.expert} ({layout.megatron_name}) has no sender; the trainer's "
                                 f"expert_senders() covers experts {sorted(expert_senders)}")
        for hf_name, shape, role in zip(layout.hf_names, layout.hf_shapes, roles, strict=True):
            if hf_name in seen:
                continue
            seen.add(hf_name)
            # An expert's fc2 is whole on the trainer (holder) and row-split on a TP engine, as a dense down_proj.
            spec_kind = "row" if holder >= 0 and kind == "replicated" else kind
            specs.append(ParamSpec(
                name=hf_name, shape=shape, dtype=dtype, kind=spec_kind, source=layout.megatron_name, role=role,
                num_heads=layout.num_heads or 0, num_kv_heads=layout.num_kv_heads or 0,
                head_dim=layout.head_dim or 0, trainer_padded_vocab=layout.padded_vocab_size or 0, holder=holder,
            ))
    return specs
