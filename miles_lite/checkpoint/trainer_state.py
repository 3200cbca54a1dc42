"""A `TrainerActor` rank's state <-> checkpoint payload, stored independently of TP and DP.

Weights and the optimizer's per-parameter tensors (Adam moments; fp32 master weights under bf16)
are cut by each parameter's `ParamLayout` into pieces of full Hugging Face tensors: `model/<hf>`,
`optim/<key>/<hf>`, `optim/master/<hf>`. Data-parallel replicas write nothing (dp_rank 0 covers
the model) and replicated tensors are written by tp_rank 0 only. Loading assembles each rank's
shards for its *current* layout, so a TP=2 checkpoint resumes at TP=1 and vice versa. Optimizer
step counts, parameter groups, the LR schedule and counters are shared; RNG streams are local and
come back only when the parallel layout is unchanged (otherwise the fresh rank's streams stay).

A LoRA run (`trainer.lora.rank` > 0) trains only its adapters: the checkpoint holds those (PEFT names
under `model/`) and their optimizer state, and its shared tree names the frozen base (`lora`), which
resuming rebuilds from the configuration and `miles-lite convert` merges the adapters into.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from miles_lite.checkpoint.payload import CheckpointPayload, GlobalPiece
from miles_lite.checkpoint.resume import CheckpointReader
from miles_lite.checkpoint.tensor_io import split_tensors
from miles_lite.trainer.dist_optimizer import DistributedOptimizerState, ParamState, group_steps, is_distributed
from miles_lite.trainer.layout import LayoutKind, ParamLayout

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
# Per-parameter state tensors of the trainer's optimizer (`trainer/optim.py` builds Megatron Adam).
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
# Files an HF tokenizer directory may hold; those present are stored with the checkpoint.
TOKENIZER_ASSETS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")


def layout_pieces(prefix: str, layout: ParamLayout, local: Tensor) -> list[GlobalPiece]:
    """Pieces of full HF tensors (named `prefix + hf_name`) that this rank's shard `local` holds."""
    return [GlobalPiece(name=prefix + piece.hf_name, tensor=part,
                        global_shape=layout.hf_shapes[layout.hf_names.index(piece.hf_name)],
                        dim=piece.dim, start=piece.start)
            for piece, part in layout.split(local)]


def assemble(reader: CheckpointReader, prefix: str, layout: ParamLayout) -> Tensor:
    """This rank's shard of the parameter `layout` describes, from the checkpoint's full tensors."""
    return layout.assemble({n: reader.global_tensor(prefix + n) for n in layout.hf_names})


def _optimizers(actor: Any) -> list[Any]:
    opt = actor.optimizer
    return list(getattr(opt, "chained_optimizers", [opt]))


def optimizer_param_names(actor: Any) -> list[list[str]]:
    """For each sub-optimizer, the Megatron parameter name of every torch-optimizer state index.

    Under bf16 the torch optimizer steps fp32 copies; they are mapped back to their model parameter.
    """
    names = {id(p): n for n, p in actor.trained.named_parameters()}
    out: list[list[str]] = []
    for sub in _optimizers(actor):
        alias: dict[int, int] = {}
        for model_group, main_group in zip(getattr(sub, "float16_groups", []),
                                           getattr(sub, "fp32_from_float16_groups", []), strict=True):
            alias.update({id(main): id(model) for model, main in zip(model_group, main_group, strict=True)})
        order = [p for group in sub.optimizer.param_groups for p in group["params"]]
        out.append([names[alias.get(id(p), id(p))] for p in order])
    return out


def _master_names(sub: Any, names: Mapping[int, str]) -> list[list[str]]:
    return [[names[id(p)] for p in group] for group in getattr(sub, "float16_groups", [])]


def _split_sub(sd: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(torch optimizer state dict, the rest) of one Megatron sub-optimizer's state dict."""
    if "state" in sd:
        return sd, {}
    return sd["optimizer"], {k: v for k, v in sd.items() if k != "optimizer"}


def checkpoint_payload(actor: Any, driver_tree: Mapping[str, Any] | None = None,
                       assets: Mapping[str, bytes | Path] | None = None,
                       meta: Mapping[str, Any] | None = None) -> CheckpointPayload:
    """This rank's payload: HF-named pieces of weights and optimizer tensors, shared and local trees.

    Args:
        actor: a ready `TrainerActor`.
        driver_tree: rank 0: the driver's state (`DriverState.to_tree()`), stored under `driver`.
        assets / meta: rank 0: files for `hf/` and manifest metadata.
    """
    sd = actor.state_dict_for_checkpoint()
    par = sd["parallel"]
    layouts: Mapping[str, ParamLayout] = actor.trained_layouts

    def mine(layout: ParamLayout) -> bool:
        return _writes(actor, layout)

    pieces: list[GlobalPiece] = []
    for name, tensor in sd["model"].items():
        if mine(layouts[name]):
            pieces += layout_pieces(MODEL_PREFIX, layouts[name], tensor)
    if isinstance(sd["optimizer"], DistributedOptimizerState):
        opt_pieces, shared_opt_tree = _distributed_pieces(sd["optimizer"], actor, mine)
        pieces += opt_pieces
        return _payload(pieces, sd, par, shared_opt_tree, driver_tree, assets, meta, actor.lora_checkpoint_info())
    subs = sd["optimizer"] if isinstance(sd["optimizer"], list) else [sd["optimizer"]]
    index_names = optimizer_param_names(actor)
    model_names = {id(p): n for n, p in actor.trained.named_parameters()}
    shared_opt: list[dict[str, Any]] = []
    for sub_sd, names, sub in zip(subs, index_names, _optimizers(actor), strict=True):
        torch_sd, rest = _split_sub(sub_sd)
        steps: dict[str, Any] = {}
        for idx, st in torch_sd["state"].items():
            name = names[idx]
            for key, value in st.items():
                if key == "step":
                    steps[name] = value
                elif isinstance(value, Tensor) and tuple(value.shape) == layouts[name].local_shape:
                    if mine(layouts[name]):
                        pieces += layout_pieces(f"{OPTIM_PREFIX}{key}/", layouts[name], value)
                else:
                    raise ValueError(f"optimizer state {key!r} of {name} has an unexpected shape; "
                                     "only per-parameter tensors and 'step' are checkpointed")
        for group_names, group in zip(_master_names(sub, model_names), rest.get("fp32_from_fp16_params", []),
                                      strict=True):
            for name, master in zip(group_names, group, strict=True):
                if mine(layouts[name]):
                    pieces += layout_pieces(f"{OPTIM_PREFIX}master/", layouts[name], master)
        shared_opt.append({"param_groups": torch_sd["param_groups"], "step": steps,
                           "grad_scaler": rest.get("grad_scaler")})
    return _payload(pieces, sd, par, shared_opt, driver_tree, assets, meta, actor.lora_checkpoint_info())


def _distributed_pieces(state: DistributedOptimizerState, actor: Any,
                        mine: Any) -> tuple[list[GlobalPiece], dict[str, Any]]:
    """Pieces of a distributed optimizer's whole per-parameter states (data-parallel rank 0 holds them), under
    the plain optimizer's names: fp32 main values (`optim/master/`, only for parameters kept in another dtype)
    and Adam moments; the shared tree marks the format and keeps the step counts."""
    pieces: list[GlobalPiece] = []
    steps: dict[str, Any] = {}
    params = dict(actor.policy.model.named_parameters())
    for name, ps in (state.params or {}).items():
        layout = actor.layouts[name]
        if not mine(layout):
            continue
        if params[name].dtype != ps.master.dtype:
            pieces += layout_pieces(f"{OPTIM_PREFIX}master/", layout, ps.master)
        for key, moment in ps.moments.items():
            pieces += layout_pieces(f"{OPTIM_PREFIX}{key}/", layout, moment)
        if ps.step is not None:
            steps[name] = ps.step
    return pieces, {"distributed": True, "step": steps, "group_steps": state.group_steps}


def _payload(pieces: list[GlobalPiece], sd: Mapping[str, Any], par: Mapping[str, Any], shared_opt: Any,
             driver_tree: Mapping[str, Any] | None, assets: Mapping[str, bytes | Path] | None,
             meta: Mapping[str, Any] | None, lora: Mapping[str, Any] | None) -> CheckpointPayload:
    shared = None
    if par["tp_rank"] == 0 and par["dp_rank"] == 0:
        shared = {"optimizer": shared_opt, "scheduler": sd["scheduler"], "counters": sd["counters"],
                  "parallel": {"tp_size": par["tp_size"], "dp_size": par["dp_size"]},
                  "driver": dict(driver_tree) if driver_tree is not None else None,
                  "lora": lora}
    meta_all = {"tp": par["tp_size"], "dp": par["dp_size"], "tensor_names": "hf", **dict(meta or {})}
    return CheckpointPayload(pieces=pieces, local={"rng": sd["rng"], "parallel": par}, shared=shared,
                             assets=assets if shared is not None else None,
                             meta=meta_all if shared is not None else None)


def _writes(actor: Any, layout: ParamLayout) -> bool:
    """Whether this rank writes `layout`'s pieces: data-parallel rank 0 for the dense model (tp_rank 0 for
    replicated tensors); for a routed expert, the first replica of its expert-parallel rank (experts of
    different EP ranks live on different data-parallel ranks)."""
    par = actor.par
    if layout.expert is not None:
        return par.edp_rank == 0
    return par.dp_rank == 0 and (layout.kind is not LayoutKind.REPLICATED or par.tp_rank == 0)


def snapshot_sizes(actor: Any) -> list[int]:
    """Byte sizes of the tensors this rank's checkpoint snapshot will hold, the optimizer's included.

    Before the first optimizer step Adam has no moments yet (torch and TE's FusedAdam create them
    lazily); they are predicted as `ADAM_MOMENTS` tensors shaped and typed like each stepped
    parameter, so that host buffers reserved from these sizes also hold the first save's moments.
    Small tensors that appear later (torch Adam's per-parameter step counters, the driver's RNG
    state) are not predicted: the save allocates those few bytes itself.
    """
    payload = checkpoint_payload(actor)
    loose: dict[str, Tensor] = {}
    split_tensors(dict(payload.local), "local", loose)
    if payload.shared is not None:
        split_tensors(dict(payload.shared), "shared", loose)
    sizes = [p.tensor.numel() * p.tensor.element_size() for p in payload.pieces]
    sizes += [t.numel() * t.element_size() for t in loose.values()]
    layouts: Mapping[str, ParamLayout] = actor.trained_layouts
    if is_distributed(actor.optimizer):
        # Moments not there yet are predicted fp32, shaped like each parameter, on the rank that writes them.
        written = {p.name.split("/", 2)[-1] for p in payload.pieces if p.name.startswith(f"{OPTIM_PREFIX}exp_avg/")}
        for name, param in actor.trained.named_parameters():
            layout = layouts[name]
            if _writes(actor, layout) and layout.hf_names[0] not in written:
                sizes += [part.numel() * 4 for _, part in layout.split(param.detach())] * len(ADAM_MOMENTS)
        return sizes
    for sub, names in zip(_optimizers(actor), optimizer_param_names(actor), strict=True):
        stepped = [p for group in sub.optimizer.param_groups for p in group["params"]]
        for param, name in zip(stepped, names, strict=True):
            layout = layouts[name]
            if sub.optimizer.state.get(param) or not _writes(actor, layout):
                continue
            piece_bytes = [part.numel() * param.element_size() for _, part in layout.split(param.detach())]
            sizes += piece_bytes * len(ADAM_MOMENTS)
    return sizes


def _distributed_state(actor: Any, reader: CheckpointReader, saved: Mapping[str, Any]) -> DistributedOptimizerState:
    """Whole per-parameter states for this rank's TP layout, from a distributed optimizer's checkpoint."""
    states: dict[str, ParamState] = {}
    for name, layout in actor.layouts.items():
        master = None
        if reader.has_global(f"{OPTIM_PREFIX}master/{layout.hf_names[0]}"):
            master = assemble(reader, f"{OPTIM_PREFIX}master/", layout)
        moments = {key: assemble(reader, f"{OPTIM_PREFIX}{key}/", layout) for key in ADAM_MOMENTS
                   if reader.has_global(f"{OPTIM_PREFIX}{key}/{layout.hf_names[0]}")}
        if master is None:  # kept in fp32: the weights are the main values
            master = assemble(reader, MODEL_PREFIX, layout).float()
        states[name] = ParamState(master, moments, saved["step"].get(name))
    return DistributedOptimizerState(states, saved["group_steps"])


def _optimizer_state(actor: Any, reader: CheckpointReader, shared_opt: Any) -> Any:
    distributed_saved = isinstance(shared_opt, dict) and shared_opt.get("distributed")
    if distributed_saved != is_distributed(actor.optimizer):
        raise ValueError(f"the checkpoint was saved with trainer.use_distributed_optimizer="
                         f"{str(bool(distributed_saved)).lower()}; resume with that setting")
    if distributed_saved:
        return _distributed_state(actor, reader, shared_opt)
    layouts: Mapping[str, ParamLayout] = actor.trained_layouts
    model_names = {id(p): n for n, p in actor.trained.named_parameters()}
    keys = sorted({n[len(OPTIM_PREFIX):].split("/", 1)[0] for n in reader.global_names(OPTIM_PREFIX)} - {"master"})
    subs = _optimizers(actor)
    # Expert parallelism puts routed experts in an optimizer of their own (megatron-core), so the number of
    # sub-optimizers changes with trainer.ep, and a parameter's saved step may come from a rank that did not
    # write the shared tree: every parameter steps together, so one whose moments were saved takes the step.
    same_structure = len(subs) == len(shared_opt)
    all_steps = [v for saved in shared_opt for v in saved["step"].values()]
    common_step = max(all_steps, key=lambda v: float(v)) if all_steps else None
    out = []
    for k, (sub, names) in enumerate(zip(subs, optimizer_param_names(actor), strict=True)):
        saved = shared_opt[k] if same_structure else {"step": {}, "param_groups": None, "grad_scaler": None}
        state: dict[int, dict[str, Any]] = {}
        for idx, name in enumerate(names):
            layout = layouts[name]
            step = saved["step"].get(name)
            if step is None and common_step is not None and reader.has_global(
                    f"{OPTIM_PREFIX}{ADAM_MOMENTS[0]}/{layout.hf_names[0]}"):
                # A copy each: torch's Adam increments its step tensor in place.
                step = common_step.clone() if isinstance(common_step, Tensor) else common_step
            if step is None:
                continue  # never stepped when saved: keeps no state
            entry: dict[str, Any] = {"step": step}
            for key in keys:
                if reader.has_global(f"{OPTIM_PREFIX}{key}/{layout.hf_names[0]}"):
                    entry[key] = assemble(reader, f"{OPTIM_PREFIX}{key}/", layout)
            state[idx] = entry
        # Another optimizer structure (EP changed): this one's groups; the LR schedule comes back on its own.
        groups = saved["param_groups"] if saved["param_groups"] is not None else \
            _torch_state_dict(sub)["param_groups"]
        torch_sd = {"state": state, "param_groups": groups}
        if not hasattr(sub, "fp32_from_float16_groups"):
            out.append(torch_sd)
            continue
        masters = [[assemble(reader, f"{OPTIM_PREFIX}master/", layouts[n]) for n in group]
                   for group in _master_names(sub, model_names)]
        sub_sd: dict[str, Any] = {"optimizer": torch_sd, "fp32_from_fp16_params": masters}
        if saved.get("grad_scaler") is not None:
            sub_sd["grad_scaler"] = saved["grad_scaler"]
        out.append(sub_sd)
    return out[0] if len(out) == 1 else out


def _torch_state_dict(sub: Any) -> dict[str, Any]:
    return sub.optimizer.state_dict()


def restore_actor(actor: Any, reader: CheckpointReader) -> dict[str, Any]:
    """Load weights, optimizer, schedule, counters (and RNG when the layout matches) into `actor`.

    Works across TP/DP changes. A checkpoint without optimizer tensors (e.g. converted from HF)
    loads weights only and keeps the actor's fresh optimizer and schedule.
    Returns the shared tree (holds the `driver` state the run saved, or None).
    """
    from miles_lite.trainer.rng import capture_rank_rng

    shared = reader.shared()
    saved_lora, lora = shared.get("lora"), actor.lora_checkpoint_info()
    if (saved_lora is None) != (lora is None) or (lora is not None and saved_lora["adapter"] != lora["adapter"]):
        def what(info: Any) -> str:
            if info is None:
                return "full weights"
            adapter = info["adapter"]
            return f"LoRA r={adapter['r']} alpha={adapter['lora_alpha']} on {adapter['target_modules']}"

        raise ValueError(f"the checkpoint holds {what(saved_lora)}, the trainer is configured for {what(lora)}; "
                         "resume with the trainer.lora settings the checkpoint was saved with")
    if lora is not None and saved_lora.get("base_sha256") and lora["base_sha256"]:
        changed = sorted(n for n, d in saved_lora["base_sha256"].items() if lora["base_sha256"].get(n) != d)
        changed += sorted(set(lora["base_sha256"]) - set(saved_lora["base_sha256"]))
        if changed:
            raise ValueError(f"the LoRA checkpoint's adapters were trained on another base than {lora['base']}: "
                             f"{len(changed)} base tensors differ (e.g. {changed[0]}); resume with the model.hf_path "
                             f"(and trainer precision) the checkpoint was saved with: {saved_lora['base']}")
    par = actor.par
    layouts: Mapping[str, ParamLayout] = actor.trained_layouts
    model = {name: assemble(reader, MODEL_PREFIX, layout) for name, layout in layouts.items()}
    distributed = is_distributed(actor.optimizer)
    has_optim = "optimizer" in shared and (distributed or bool(reader.global_names(OPTIM_PREFIX)))
    if distributed and not has_optim:  # weights only: a fresh distributed optimizer over them
        fresh: Any = DistributedOptimizerState({}, group_steps(actor.optimizer))
    same_layout = shared.get("parallel") == {"tp_size": par.tp_size, "dp_size": par.dp_size}
    local = reader.local(par.rank) if same_layout else None
    state = {
        "model": model,
        "optimizer": _optimizer_state(actor, reader, shared["optimizer"]) if has_optim
        else fresh if distributed else actor.optimizer.state_dict(),
        "scheduler": shared["scheduler"] if "scheduler" in shared else actor.scheduler.state_dict(),
        "rng": local["rng"] if local is not None else capture_rank_rng(),
        "counters": shared.get("counters", {"steps_done": 0, "nonfinite_in_a_row": 0, "nonfinite_total": 0}),
        "parallel": {"tp_rank": par.tp_rank, "tp_size": par.tp_size},
    }
    actor.load_checkpoint_state(state)
    return shared


def hf_assets(hf_config: Mapping[str, Any], tokenizer_dir: str | Path | None) -> dict[str, bytes | Path]:
    """`config.json` (from the model's HF config) plus the tokenizer files found in `tokenizer_dir`."""
    assets: dict[str, bytes | Path] = {"config.json": json.dumps(dict(hf_config), indent=2, default=str).encode()}
    if tokenizer_dir is not None:
        root = Path(tokenizer_dir)
        assets.update({f: root / f for f in TOKENIZER_ASSETS if (root / f).is_file()})
    return assets


def hf_pieces(hf_state: Mapping[str, Tensor], skip: Iterable[str] = ()) -> list[GlobalPiece]:
    """Whole-tensor `model/<hf name>` pieces of a full HF state dict (an initial checkpoint)."""
    skipped = set(skip)
    return [GlobalPiece.whole(MODEL_PREFIX + n, t) for n, t in hf_state.items() if n not in skipped]
