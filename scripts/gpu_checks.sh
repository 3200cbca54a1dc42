#!/usr/bin/env bash
# The GPU checks of the SGLang stack (dense and MoE), the divergence guard and the GSM8K recipe, on one GPU, in one batch.
#
#   scripts/gpu_checks.sh OUT_DIR [PART...]      # every part, or the named ones
#
# Parts: versions unit engine contract auth moe multiturn trainer recipe guard-0.5b guard-7b prefill-graphs lora,
# and, not in the default list, the colocated hand-off ones (colocated-0.5b resident-0.5b colocated-7b lora-7b) and
# the RL step against the bare megatron-core step at the recipe's shape, with RoPE fused (the default on THD
# rows) and unfused (speed-recipe speed-recipe-unfused).
# (`contract` is the engine contract alone, one small engine; `engine` adds the weight pushes at 0.5B.)
# Runs `python3` (PYTHON overrides it) from the repository root, which goes first on PYTHONPATH; SGLang,
# TransformerEngine and megatron-core must import there, or set MILES_ENGINE_PYTHONPATH to SGLang installed
# apart (then MILES_TEST_TRANSPORT=ipc_handles if its torch is another build). Each part writes
# OUT_DIR/<part>.log (benchmarks also OUT_DIR/<part>.json); a failing part does not stop the others; the exit
# status is the number of parts that failed. PART_TIMEOUT_S (default 3600) bounds each part. The GRPO parts
# (benchmarks/grpo_steps.py) rewrite their JSON after every step and print unbuffered, so a part cut short
# still leaves the steps it finished.
set -u
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [PART...]}
shift
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A part cut short by its time bound still leaves what it printed, and its tests' temporary directories (the
# engines' own logs among them) are under OUT_DIR/tmp-<part>.
export PYTHONUNBUFFERED=1
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(versions unit engine auth moe multiturn trainer recipe guard-0.5b guard-7b prefill-graphs lora)
failed=0
# The GRPO parts' engines see SGLang installed apart, and push as the other GPU checks do.
grpo=(-u benchmarks/grpo_steps.py --transport "${MILES_TEST_TRANSPORT:-ipc_handles}")
[ -n "${MILES_ENGINE_PYTHONPATH:-}" ] && grpo+=(--engine-env "PYTHONPATH=$MILES_ENGINE_PYTHONPATH")

part() {
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS rc=0
  # PART_TIMEOUT_S bounds each part (a hung engine must not eat the time left for the parts after it).
  if timeout --kill-after=10 "${PART_TIMEOUT_S:-3600}" "$@" >"$out/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - start)) s)"
  else
    echo "   FAILED ($((SECONDS - start)) s): $out/$name.log"
    failed=$((failed + 1))
    rc=1
  fi
  tail -n 4 "$out/$name.log" | sed 's/^/   /'
  return $rc
}

# A GRPO part: its run (engines' logs among its files) under a temporary directory of its own; whatever the
# part's end (a failure, its time bound), the logs come back flattened into OUT_DIR/<part>.logs/, the last
# 20 MiB of each.
grpo_part() {
  local name=$1
  shift
  local tmp rc=0
  tmp=$(mktemp -d "/tmp/gpu-checks-$name.XXXX")
  TMPDIR=$tmp part "$name" "$@" || rc=1
  mkdir -p "$out/$name.logs"
  find "$tmp" -name '*.log' -type f | while read -r f; do
    tail -c 20M "$f" > "$out/$name.logs/$(realpath --relative-to="$tmp" "$f" | tr / _)"
  done
  return $rc
}

# An engine from the shipped defaults but with prefill CUDA graphs on, on the small shape that crashed
# SGLang 0.5.10: whether the installed SGLang still needs them off.
PREFILL_GRAPHS='
import asyncio, sys, tempfile, yaml
from pathlib import Path
from miles_lite.config.schema import RolloutConfig, TinyModelShape
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.trainer.tiny_hf import make_tiny_hf_model
from miles_lite.types import SamplingParams
shape = TinyModelShape(hidden_size=256, ffn_hidden_size=512, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                       max_position_embeddings=1024)
root = Path(tempfile.mkdtemp())
model = make_tiny_hf_model("qwen2", shape, 512, root / "model", seed=3)
args = yaml.safe_load(Path("conf/rollout/sglang.yaml").read_text())["sglang_args"]
args.update(disable_prefill_cuda_graph=False, mem_fraction_static=0.3, dtype="bfloat16")
rollout = RolloutConfig(backend="sglang", startup_timeout_s=600.0, sglang_args=args)
async def main():
    launcher = EngineLauncher(rollout, str(model), str(root / "logs"))
    engine = await launcher.start(0)
    try:
        gen = await engine.client.generate(list(range(1, 40)), SamplingParams(max_new_tokens=16, temperature=0.0))
        print("prefill graphs on: started and generated", len(gen.output_ids), "tokens")
    finally:
        await launcher.stop(engine)
asyncio.run(main())
'

# After the LoRA GRPO steps: each push's bytes and seconds (the run's metrics.jsonl) into the part's JSON.
LORA_PUSH='
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
result = json.loads(path.read_text())
rows = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
result["push"] = [{"step": m["step"], "bytes": m["sync/bytes"], "seconds": m["sync/seconds"],
                   "probe_logp_diff_mean": m.get("sync/probe_logp_diff_mean")} for m in rows if "sync/bytes" in m]
path.write_text(json.dumps(result, indent=1))
print("LoRA push bytes:", [p["bytes"] for p in result["push"]], "seconds:", [round(p["seconds"], 3) for p in result["push"]])
'

# LoRA: the adapter-serving checks against a stock SGLang (the test must run, not skip), then GRPO steps of
# the recipe's shape with rank-16 adapters on every projection, pushed as adapters, and each push's bytes.
# A failed part counts once: a skipped SGLang check is a failure of its own, the push figures need the run.
lora_parts() {
  if part lora-engine "$py" -m pytest -q -s -rs --basetemp "$out/tmp-lora" -k sglang tests/integration/test_lora_engine.py \
      && grep -q " skipped" "$out/lora-engine.log"; then
    echo "   the SGLang LoRA check was skipped"
    failed=$((failed + 1))
  fi
  grpo_part lora "$py" "${grpo[@]}" --steps 5 --skip 1 --out "$out/lora.json" trainer.lora.rank=16 trainer.lora.alpha=32 \
    && part lora-push "$py" -c "$LORA_PUSH" "$out/lora.json"
}

for p in "${parts[@]}"; do
  case $p in
    versions) part versions "$py" -c "
import importlib.metadata as md, sys, torch
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())
for d in ('sglang', 'transformer_engine', 'megatron-core', 'transformers', 'flashinfer-python'):
    try: print(d, md.version(d))
    except md.PackageNotFoundError: print(d, 'absent here')" ;;
    unit) part unit "$py" -m pytest -q tests/unit/test_sglang_args.py tests/unit/test_sglang_payloads.py \
            tests/unit/test_http_score.py tests/unit/test_lifeline.py tests/unit/test_update_guard.py \
            tests/unit/test_colocation.py ;;
    engine) part engine "$py" -m pytest -q -s --basetemp "$out/tmp-engine" tests/gpu/test_sglang_gpu.py ;;
    contract) part contract "$py" -m pytest -q -s --basetemp "$out/tmp-contract" tests/gpu/test_sglang_gpu.py -k TestSGLangContract ;;
    auth) part auth "$py" -m pytest -q -s --basetemp "$out/tmp-auth" tests/gpu/test_sglang_auth_gpu.py ;;
    moe) part moe "$py" -m pytest -q -s --basetemp "$out/tmp-moe" tests/gpu/test_sglang_moe_gpu.py ;;
    multiturn) part multiturn "$py" -m pytest -q -s --basetemp "$out/tmp-multiturn" tests/integration/test_multi_turn_engines.py ;;
    trainer) part trainer "$py" -m pytest -q -s --basetemp "$out/tmp-trainer" tests/gpu/test_trainer_gpu.py ;;
    recipe) part recipe "$py" -m pytest -q -s --basetemp "$out/tmp-recipe" tests/gpu/test_gsm8k_recipe_gpu.py ;;
    guard-0.5b) part guard-0.5b "$py" benchmarks/train_step.py --guard --configs bf16,fp8-delayed --steps 20 \
                  --warmup 2 --out "$out/guard-0.5b.json" ;;
    guard-7b) part guard-7b "$py" benchmarks/train_step.py --guard --shape qwen2.5-7b-w6 \
                --configs bf16,fp8-delayed,fp8-tensorwise --steps 20 --warmup 2 --out "$out/guard-7b.json" ;;
    prefill-graphs) part prefill-graphs "$py" -c "$PREFILL_GRAPHS" ;;
    # 512 sequences of 480 tokens (224 of prompt): about 34 sequences in each 16384-token micro-batch.
    speed-recipe) part speed-recipe "$py" benchmarks/train_step.py --bare --configs bf16 --batch 512 --seq 480 \
                    --prompt-tokens 224 --steps 20 --warmup 2 --out "$out/speed-recipe.json" ;;
    speed-recipe-unfused) part speed-recipe-unfused "$py" benchmarks/train_step.py --bare --configs bf16 \
                            --batch 512 --seq 480 --prompt-tokens 224 --steps 20 --warmup 2 \
                            --transformer apply_rope_fusion=false --out "$out/speed-recipe-unfused.json" ;;
    # GRPO steps of the GSM8K shape, trainer and SGLang on one GPU: handing the GPU over, then both resident.
    colocated-0.5b) grpo_part colocated-0.5b "$py" "${grpo[@]}" --memory handoff --steps 8 --skip 2 \
                      --out "$out/colocated-0.5b.json" ;;
    resident-0.5b) grpo_part resident-0.5b "$py" "${grpo[@]}" --memory resident --steps 8 --skip 2 \
                     --out "$out/resident-0.5b.json" ;;
    colocated-7b) grpo_part colocated-7b "$py" "${grpo[@]}" --shape qwen2.5-7b --memory handoff \
                    --steps 3 --skip 1 --out "$out/colocated-7b.json" ;;
    lora) lora_parts ;;
    # Whether a colocated LoRA GRPO step of the whole Qwen2.5-7B fits, its time and memory.
    lora-7b) grpo_part lora-7b "$py" "${grpo[@]}" --shape qwen2.5-7b --memory handoff --steps 3 --skip 1 \
               --out "$out/lora-7b.json" trainer.lora.rank=16 trainer.lora.alpha=32 ;;
    *) echo "unknown part $p (versions unit engine contract auth moe multiturn trainer recipe guard-0.5b guard-7b prefill-graphs" \
            "lora colocated-0.5b resident-0.5b colocated-7b lora-7b speed-recipe speed-recipe-unfused)"
       failed=$((failed + 1)) ;;
  esac
done
exit "$failed"
