"""LoRA on real Megatron trainer ranks (gloo, CPU): frozen base, adapters alone in the optimizer, TP=2 equal
to TP=1, bit-exact resume, and the checkpoint's PEFT export loaded by `peft` with the trainer's logits.

Run A (TP=1): 2 steps, checkpoint, 2 more steps. Run B (TP=2): the same 4 steps. Run C (TP=1, new process):
resume A's checkpoint, 2 steps -> A's final adapters bit for bit. Run D: resuming A's checkpoint onto another
base is refused (the checkpoint pins its base by the SHA-256 of every base tensor).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trainer_harness import make_test_checkpoint, run_ranks
from trainer_scenarios import make_batch, make_config

from miles_lite.checkpoint import CheckpointReader, DriverState, newest_complete
from miles_lite.checkpoint.run_state import RankCheckpointer
from miles_lite.cli import main
from miles_lite.config.views import ActorConfig
from miles_lite.formats.lora import TARGETS, LoraSpec, merged_state, tensor_name
from miles_lite.trainer.hf_convert import read_hf_state, tensor_sha256

pytestmark = pytest.mark.timeout(900)

VOCAB = 500
RANK, ALPHA = 4, 8.0


def _config(hf_path: str, ckpt_dir: str, tp: int) -> Any:
    cfg = make_config(hf_path, tp=tp)
    cfg.trainer.lora.rank, cfg.trainer.lora.alpha = RANK, ALPHA
    cfg.trainer.lr = 2e-2
    cfg.checkpoint.dir = ckpt_dir
    return cfg


def _step(actor: Any, k: int) -> None:
    actor.train_step(make_batch(VOCAB, n=4, seed=100 + k))


def scenario_train(rank: int, world_size: int, hf_path: str, ckpt_dir: str) -> dict[str, Any]:
    from miles_lite.trainer.actor import TrainerActor

    cfg = _config(hf_path, ckpt_dir, world_size)
    actor = TrainerActor(ActorConfig.of(cfg), rank, world_size)
    base = {n: p.detach().clone() for n, p in actor.policy.model.named_parameters()}
    stepped = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for p in actor.lora.parameters()}
    frozen = not any(p.requires_grad for p in actor.policy.model.parameters())
    init = actor.adapter_state()
    ckpt = RankCheckpointer(cfg.checkpoint, cfg.model)
    for k in range(2):
        _step(actor, k)
    probe = make_batch(VOCAB, n=3, seed=7)
    saved_logprobs = actor.compute_logprobs(probe)
    saved_adapters = actor.adapter_state()
    ckpt.save(actor, 2, DriverState(step=2, weight_version=2, data={}))
    for k in range(2, 4):
        _step(actor, k)
    ckpt.finalize()
    ckpt.close()
    out = {"base_identical": all(torch.equal(base[n], p) for n, p in actor.policy.model.named_parameters()),
           "optimizer_is_adapters": stepped == adapters, "frozen": frozen, "init": init, "saved": saved_adapters,
           "saved_logprobs": saved_logprobs, "final": actor.adapter_state(), "merged": actor.export_hf_state_dict(),
           "reference_is_base": actor.compute_logprobs(probe, "reference"),
           "fused": fused_against_per_projection(actor)}
    actor.close()
    return out


def scenario_resume(rank: int, world_size: int, hf_path: str, ckpt_dir: str) -> dict[str, Any]:
    from miles_lite.trainer.actor import TrainerActor

    actor = TrainerActor(ActorConfig.of(_config(hf_path, ckpt_dir, world_size)), rank, world_size)
    path = newest_complete(ckpt_dir)
    assert path is not None
    RankCheckpointer.restore(actor, path)
    loaded = actor.adapter_state()
    for k in range(2, 4):
        _step(actor, k)
    out = {"loaded": loaded, "final": actor.adapter_state()}
    actor.close()
    return out


def scenario_resume_elsewhere(rank: int, world_size: int, hf_path: str, ckpt_dir: str) -> dict[str, Any]:
    from miles_lite.trainer.actor import TrainerActor

    actor = TrainerActor(ActorConfig.of(_config(hf_path, ckpt_dir, world_size)), rank, world_size)
    try:
        RankCheckpointer.restore(actor, newest_complete(ckpt_dir))  # type: ignore[arg-type]
    except ValueError as err:
        return {"error": str(err)}
    finally:
        actor.close()
    return {"error": None}


def scenario_recompute(rank: int, world_size: int, hf_path: str, ckpt_dir: str) -> dict[str, Any]:
    """The adapters' gradients of one step with and without megatron's full activation recompute (the 7B
    recipe's setting): what the step reduced into the gradient buffers, which the next step zeroes."""
    from miles_lite.trainer.actor import TrainerActor

    out = {}
    for recompute in (False, True):
        cfg = _config(hf_path, ckpt_dir, world_size)
        cfg.trainer.clip_grad = 0.0  # the raw gradients (clipping would scale each run by its own norm)
        if recompute:
            cfg.trainer.transformer.update(recompute_granularity="full", recompute_method="uniform",
                                           recompute_num_layers=1)
        actor = TrainerActor(ActorConfig.of(cfg), rank, world_size)
        _step(actor, 0)
        out[recompute] = {name: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach()
                          .to("cpu", copy=True) for name, p in actor.lora.named_parameters()}
        actor.close()
    return out


def fused_against_per_projection(actor: Any) -> dict[str, Any]:
    """Layer 1's adapted outputs and the adapters' gradients through the fused GEMMs (`_add_fused`) and through
    one delta per projection laid out afterwards (the dropout path), for all of a fused layer's projections and
    for some (the others' rows zero), on random inputs with the trained adapters."""
    from miles_lite.trainer.lora import FUSED

    lora, layer = actor.lora, actor.policy.model.decoder.layers[1]
    gen = torch.Generator().manual_seed(5)
    out: dict[str, Any] = {}
    for path, names in FUSED.items():
        module = layer.get_submodule(path)
        for targets in dict.fromkeys([tuple(names), names[-1:]]):  # one order on every rank
            x = torch.randn(3, 2, module.weight.shape[1], generator=gen)
            base = torch.randn(3, 2, module.weight.shape[0], generator=gen)
            params = [getattr(lora.layers[1][t], w) for t in targets for w in ("lora_A", "lora_B")]
            results = []
            for fused in (True, False):
                xi, bi = x.clone().requires_grad_(True), base.clone().requires_grad_(True)
                if fused:
                    y = lora._add_fused(1, path, list(targets), xi, bi)
                else:
                    y = bi + lora._fuse(path, {t: lora._delta(1, t, xi) for t in targets})
                loss = (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum()
                results.append([g.detach() for g in torch.autograd.grad(loss, [xi, bi, *params])] + [y.detach()])
            out[f"{path}:{','.join(targets)}"] = results
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_trainer")
    hf = make_test_checkpoint("qwen2", root / "hf", vocab_size=VOCAB)
    a = run_ranks(scenario_train, 1, root / "a", hf_path=str(hf), ckpt_dir=str(root / "ckpt_a"))[0]
    return {"root": root, "hf": hf, "a": a}


def test_base_frozen_and_only_adapters_stepped(runs: dict[str, Any]) -> None:
    a = runs["a"]
    assert_fused_equals_per_projection(a["fused"])
    assert a["base_identical"] and a["frozen"] and a["optimizer_is_adapters"]
    names = {tensor_name(i, t, w) for i in range(2) for t in TARGETS for w in "AB"}
    assert set(a["final"]) == names
    for name, tensor in a["final"].items():
        if name.endswith("lora_B.weight"):
            assert float(a["init"][name].abs().max()) == 0.0 and float(tensor.abs().max()) > 0.0, name
        assert not torch.equal(tensor, a["init"][name]), name  # every adapter matrix moved
    # The KL reference of a LoRA run is its base: the adapters switched off.
    from trainer_scenarios import hf_logprobs

    want = hf_logprobs(str(runs["hf"]), make_batch(VOCAB, n=3, seed=7))
    got = a["reference_is_base"]
    assert max(abs(x - y) for r, s in zip(got, want, strict=True) for x, y in zip(r, s, strict=True)) < 1e-4


def test_tp2_adapters_equal_tp1(runs: dict[str, Any]) -> None:
    root, a = runs["root"], runs["a"]
    b = run_ranks(scenario_train, 2, root / "b", hf_path=str(runs["hf"]), ckpt_dir=str(root / "ckpt_b"))[0]
    assert b["base_identical"] and b["optimizer_is_adapters"]
    assert_fused_equals_per_projection(b["fused"])
    for name, tensor in a["init"].items():
        assert torch.equal(b["init"][name], tensor), name  # same initialisation, whatever the sharding
    # TP changes only the reduction order. Adam divides each gradient by its own running RMS, so where a
    # gradient is tiny its rounding becomes a visible step: the bound is relative to how far the four steps
    # moved the adapters (0.08 here; 9e-5 measured, the bias-free case of a full fine-tune's 1e-3 bound).
    moved = max(float((t - a["init"][n]).abs().max()) for n, t in a["final"].items())
    diff = max(float((b["final"][n] - t).abs().max()) for n, t in a["final"].items())
    assert moved > 1e-2 and diff < 5e-3 * moved, (diff, moved)
    # The TP=2 merged export (base + adapters per fused shard, gathered) is the base with its adapters merged.
    spec = LoraSpec(RANK, ALPHA, 0.0, TARGETS)
    for run in (a, b):
        want = merged_state(read_hf_state(runs["hf"]), run["final"], spec)
        for name, tensor in run["merged"].items():
            assert torch.allclose(tensor, want[name], rtol=0, atol=1e-6), name


def test_resume_continues_bit_exactly(runs: dict[str, Any]) -> None:
    root, a = runs["root"], runs["a"]
    c = run_ranks(scenario_resume, 1, root / "c", hf_path=str(runs["hf"]), ckpt_dir=str(root / "ckpt_a"))[0]
    for name, tensor in a["saved"].items():
        assert torch.equal(c["loaded"][name], tensor), name
    for name, tensor in a["final"].items():
        assert torch.equal(c["final"][name], tensor), name
    reader = CheckpointReader(newest_complete(root / "ckpt_a"))  # type: ignore[arg-type]
    # Adapters and their Adam state only, plus the base they sit on.
    assert {n.split("/", 1)[0] for n in reader.global_names()} == {"model", "optim"}
    assert all("lora_" in n for n in reader.global_names())
    assert reader.shared()["lora"]["base"] == {"hf_path": str(runs["hf"])}
    # The base, fingerprinted at the save after two steps, has the bits of the HF model it was loaded from.
    base = read_hf_state(runs["hf"])
    digests = reader.shared()["lora"]["base_sha256"]
    assert set(digests) == set(base) - {"lm_head.weight"}  # tied embeddings
    assert all(digests[n] == tensor_sha256(t) for n, t in base.items() if n in digests)


def test_resume_onto_another_base_is_refused(runs: dict[str, Any]) -> None:
    root = runs["root"]
    other = make_test_checkpoint("qwen2", root / "other", vocab_size=VOCAB, seed=1)
    d = run_ranks(scenario_resume_elsewhere, 1, root / "d", hf_path=str(other), ckpt_dir=str(root / "ckpt_a"))[0]
    assert d["error"] is not None and "base tensors differ" in d["error"] and str(runs["hf"]) in d["error"], d


def test_peft_export_loads_with_equal_logits(runs: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    root, a = runs["root"], runs["a"]
    ckpt = root / "ckpt_a"
    assert main(["convert", "--to-hf", str(ckpt), str(root / "adapter"), "--adapter"]) == 0
    assert main(["convert", "--to-hf", str(ckpt), str(root / "merged")]) == 0
    capsys.readouterr()
    assert {p.name for p in (root / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    base = AutoModelForCausalLM.from_pretrained(str(runs["hf"]), dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(root / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32).eval()
    batch = make_batch(VOCAB, n=3, seed=7)
    for seq, plen, want in zip(batch.tokens, batch.prompt_lengths, a["saved_logprobs"], strict=True):
        ids = torch.tensor([seq])
        with torch.no_grad():
            peft_logits = model(input_ids=ids).logits
            merged_logits = merged(input_ids=ids).logits
        assert torch.allclose(peft_logits, merged_logits, rtol=0, atol=1e-4)
        logp = torch.log_softmax(peft_logits[0, :-1].float(), dim=-1)
        got = logp.gather(-1, ids[0, 1:, None])[:, 0][plen - 1:]
        assert torch.allclose(got, torch.tensor(want), rtol=0, atol=1e-4)
    # The adapters moved the model: the base alone scores differently.
    ids = torch.tensor([batch.tokens[0]])
    with torch.no_grad():
        with model.disable_adapter():
            base_logits = model(input_ids=ids).logits
        assert float((base_logits - merged(input_ids=ids).logits).abs().max()) > 1e-3


def test_full_activation_recompute_trains_the_adapters_alike(runs: dict[str, Any]) -> None:
    # Recomputed layers with a frozen base and embedding: without the embedding's output marked as needing
    # grad, the adapters inside got none ("element 0 of tensors does not require grad").
    root = runs["root"]
    got = run_ranks(scenario_recompute, 1, root / "recompute", hf_path=str(runs["hf"]), ckpt_dir=str(root / "r"))[0]
    plain, recomputed = got[False], got[True]
    assert set(recomputed) == set(plain) and plain
    # Recomputing the forward in the backward pass may round differently (another kernel order), so the two
    # gradients agree to fp32 rounding relative to each tensor's scale, not bit for bit; a gradient lost or
    # mis-routed through the recomputed layers is off by its whole size.
    for name, grad in recomputed.items():
        scale = float(plain[name].abs().max())
        assert torch.allclose(grad, plain[name], rtol=1e-4, atol=1e-5 * scale), name
    # B starts at zero, so A's gradient is zero; every B must receive one, through every recomputed layer.
    b_grads = {n: g for n, g in recomputed.items() if n.endswith("lora_B")}
    assert b_grads and all(float(g.abs().max()) > 0 for g in b_grads.values()), sorted(b_grads)


def assert_fused_equals_per_projection(fused: dict[str, Any]) -> None:
    # Without dropout a fused layer's adapters run as two GEMMs accumulated into its output; with dropout each
    # projection keeps its own mask. Both must be the same function with the same gradients.
    assert len(fused) == 6  # qkv and fc1 whole and in part, o and down
    for key, (got, want) in fused.items():
        assert len(got) == len(want) >= 5, key
        for g, w in zip(got, want, strict=True):
            assert float(g.abs().max()) > 0, key
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), key
