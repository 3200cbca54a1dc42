#!/usr/bin/env bash
# The GPU checks of the SGLang stack (dense and MoE), the divergence guard and the GSM8K recipe, on one GPU, in one batch.
#
#   scripts/gpu_checks.sh OUT_DIR [PART...]      # every part, or the named ones
#
# Parts: versions unit engine contract auth moe multiturn agent trainer recipe guard-0.5b guard-7b prefill-graphs lora
# combinations (optimizer CPU offload with a resume, LoRA with FP8, the hand-off with FP8),
# and, not in the default list, the colocated hand-off ones (colocated-0.5b colocated-0.5b-kept resident-0.5b
# colocated-7b colocated-7b-kept lora-7b lora-7b-merged lora-7b-tensors) and
# the RL step against the bare megatron-core step at the recipe's shape, with RoPE fused (the default on THD
# rows) and unfused (speed-recipe speed-recipe-unfused).
# (`contract` is the engine contract alone, one small engine; `engine` adds the weight pushes at 0.5B.)
# `sitting` is the preset of one GPU sitting (meant for 20 minutes of device time with staging; its parts take
# longer today, on one H100: 0.5B hand-off 257-326 s, RL/bare in bf16 and FP8 482 s, generation at 256 and 512
# ~350 s (512 alone 237 s), the guard at 7B width 241 s, the recipe test 171 s; staging ~65 s): the figures of the
# GRPO step's speed first (generation against raw SGLang, the recipe test, the RL step against the bare one in
# bf16 and FP8 with profiler traces, the 0.5B and 7B hand-offs, the 7B LoRA step with merged, adapter-directory
# and adapter-tensor pushes,
# the guard at 7B width), then the SGLang checks (agents, auth, MoE, contract); every part bounded by its own
# time, OUT_DIR/summary.md rewritten after each (scripts/gpu_summary.py), so a sitting cut short still brings
# back what it measured. SITTING_PARTS overrides its list; scripts/gpu_sitting.sh runs a sitting detached and
# packs what it has written at any point.
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
# The card's clocks, power, temperature and clock-event (throttle) reasons every 5 s while the checks run
# (OUT_DIR/gpu-clocks.csv, summarised per part): a 512-request pass once fell from 65k to 16k tokens/s in
# mid-part, decode graphs on and the KV cache 3% full, which the engine's own log cannot explain.
if command -v nvidia-smi >/dev/null; then
  # The field's name on newer drivers, else the older drivers' name for it (an unknown field fails the query).
  reasons=clocks_event_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv >/dev/null 2>&1 || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu,$reasons \
    --format=csv,noheader,nounits -l 5 >"$out/gpu-clocks.csv" 2>&1 &
  sampler=$!
  trap 'kill "$sampler" 2>/dev/null' EXIT
fi
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(versions unit engine auth moe multiturn agent trainer recipe guard-0.5b guard-7b prefill-graphs lora
                                 combinations)
if [ "${parts[*]}" = sitting ]; then
  export SITTING=1
  export GUARD_7B_CONFIGS=${GUARD_7B_CONFIGS:-bf16,fp8-delayed}
  # shellcheck disable=SC2206
  # The figures still missing first (a sitting often gets only part of its time), the checks that passed last after.
  parts=(${SITTING_PARTS:-versions colocated-0.5b speed-recipe rollout colocated-7b lora-7b-merged lora-7b-tensors
         guard-7b lora-7b trainer-offload recipe agent rollout-default auth moe contract})
fi
failed=0
# The GRPO parts' engines see SGLang installed apart, and push as the other GPU checks do.
grpo=(-u benchmarks/grpo_steps.py --transport "${MILES_TEST_TRANSPORT:-ipc_handles}")
[ -n "${MILES_ENGINE_PYTHONPATH:-}" ] && grpo+=(--engine-env "PYTHONPATH=$MILES_ENGINE_PYTHONPATH")

part() {
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS rc=0 started
  started=$(date '+%Y/%m/%d %H:%M:%S')
  # PART_TIMEOUT_S bounds each part (a hung engine must not eat the time left for the parts after it); a
  # sitting gives each part its own bound (the sitting_limit table below).
  if timeout --kill-after=10 "$(part_limit "$name")" "$@" >"$out/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - start)) s)"
  else
    echo "   FAILED ($((SECONDS - start)) s): $out/$name.log"
    failed=$((failed + 1))
    rc=1
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$([ $rc = 0 ] && echo ok || echo failed)" "$((SECONDS - start))" "$started" \
    >>"$out/parts.tsv"
  "$py" scripts/gpu_summary.py "$out" >/dev/null 2>&1 || true
  tail -n 4 "$out/$name.log" | sed 's/^/   /'
  return $rc
}

# Seconds each part of a sitting may take (default PART_TIMEOUT_S, else 3600).
# rollout: the engine's start with decode graphs to 512 took 172 s on an H100, then 20 rounds at 256 and 512.
# speed-recipe: FP8 alone took 262 s on an H100 (20 interleaved rounds and the profiles); bf16 and FP8 together
# need about twice that.
declare -A sitting_limit=([versions]=60 [rollout]=480 [rollout-default]=150 [recipe]=420 [speed-recipe]=540
                          [colocated-0.5b]=420 [colocated-0.5b-kept]=420 [colocated-7b]=330 [colocated-7b-kept]=330
                          [lora-7b-merged]=330 [lora-7b]=330 [lora-7b-tensors]=330 [guard-7b]=240
                          [trainer-offload]=120 [agent]=300 [combinations]=480 [auth]=240 [moe]=300 [contract]=300)
part_limit() {
  local key=$1
  [[ $key == guard-7b-* ]] && key=guard-7b  # each precision's process of the part
  if [ -n "${SITTING:-}" ] && [ -n "${sitting_limit[$key]:-}" ]; then echo "${sitting_limit[$key]}"
  else echo "${PART_TIMEOUT_S:-3600}"; fi
}

# A GRPO part: its run (engines' logs among its files) under a temporary directory of its own; whatever the
# part's end (a failure, its time bound), the logs (and a dead engine's stacks) come back flattened into
# OUT_DIR/<part>.logs/, the last 20 MiB of each.
grpo_part() {
  local name=$1
  shift
  local tmp rc=0
  tmp=$(mktemp -d "/tmp/gpu-checks-$name.XXXX")
  TMPDIR=$tmp part "$name" "$@" || rc=1
  mkdir -p "$out/$name.logs"
  find "$tmp" \( -name '*.log' -o -name '*.stacks.txt' \) -type f | while read -r f; do
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
    # Also the shell's open-files limits, which engines start under (SGLang holds a descriptor per connection), and
    # whether Python may write compiled modules and reads them for SGLang's (each process compiling what it
    # imports from source is start-up time of every engine and trainer).
    versions) part versions "$py" -c "
import importlib.metadata as md, os, sys, torch
print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())
for d in ('sglang', 'transformer_engine', 'megatron-core', 'transformers', 'flashinfer-python'):
    try: print(d, md.version(d))
    except md.PackageNotFoundError: print(d, 'absent here')
print('open files (ulimit -Sn / -Hn): $(ulimit -Sn) / $(ulimit -Hn)')
import sglang.srt.server_args as m
print('bytecode: dont_write', sys.flags.dont_write_bytecode, 'PYTHONDONTWRITEBYTECODE', os.environ.get('PYTHONDONTWRITEBYTECODE'),
      'pycache_prefix', sys.pycache_prefix, 'sglang module from', type(m.__spec__.loader).__name__, m.__spec__.cached,
      'exists', os.path.exists(m.__spec__.cached or ''))" ;;
    unit) part unit "$py" -m pytest -q tests/unit/test_sglang_args.py tests/unit/test_sglang_payloads.py \
            tests/unit/test_http_score.py tests/unit/test_lifeline.py tests/unit/test_update_guard.py \
            tests/unit/test_colocation.py ;;
    engine) part engine "$py" -m pytest -q -s --basetemp "$out/tmp-engine" tests/gpu/test_sglang_gpu.py ;;
    contract) part contract "$py" -m pytest -q -s --basetemp "$out/tmp-contract" tests/gpu/test_sglang_gpu.py -k TestSGLangContract ;;
    auth) part auth "$py" -m pytest -q -s --basetemp "$out/tmp-auth" tests/gpu/test_sglang_auth_gpu.py ;;
    moe) part moe "$py" -m pytest -q -s --basetemp "$out/tmp-moe" tests/gpu/test_sglang_moe_gpu.py ;;
    multiturn) part multiturn "$py" -m pytest -q -s --basetemp "$out/tmp-multiturn" tests/integration/test_multi_turn_engines.py ;;
    # Agent sessions through the gateway on stock SGLang (`miles-lite train rollout=sglang rollout.agent=...`).
    agent) part agent "$py" -m pytest -q -s --basetemp "$out/tmp-agent" tests/gpu/test_agent_sglang_gpu.py ;;
    trainer) part trainer "$py" -m pytest -q -s --basetemp "$out/tmp-trainer" tests/gpu/test_trainer_gpu.py ;;
    trainer-offload) part trainer-offload "$py" -m pytest -q -s --basetemp "$out/tmp-trainer-offload" \
                       tests/gpu/test_trainer_gpu.py -k offload ;;
    recipe) part recipe "$py" -m pytest -q -s --basetemp "$out/tmp-recipe" tests/gpu/test_gsm8k_recipe_gpu.py ;;
    combinations) part combinations "$py" -m pytest -q -s -rs --basetemp "$out/tmp-combinations" \
                    tests/gpu/test_option_combinations_gpu.py ;;
    guard-0.5b) part guard-0.5b "$py" benchmarks/train_step.py --guard --configs bf16,fp8-delayed --steps 20 \
                  --warmup 2 --out "$out/guard-0.5b.json" ;;
    # One process per precision: one process keeps the earlier precisions' allocations (FP8 delayed peaked at
    # 104 GiB after bf16 on an H200; alone each takes about 62 GiB, so they fit an H100 one by one).
    guard-7b) for c in $(echo "${GUARD_7B_CONFIGS:-bf16,fp8-delayed,fp8-tensorwise}" | tr , ' '); do
                part "guard-7b-$c" "$py" benchmarks/train_step.py --guard --shape qwen2.5-7b-w6 --configs "$c" \
                  --steps 20 --warmup 2 --out "$out/guard-7b-$c.json"
              done ;;
    prefill-graphs) part prefill-graphs "$py" -c "$PREFILL_GRAPHS" ;;
    # 512 sequences of 480 tokens (224 of prompt): about 34 sequences in each 16384-token micro-batch.
    # SPEED_RECIPE_CONFIGS picks the precisions (e.g. fp8-delayed alone when bf16 was measured in a lease before).
    speed-recipe) part speed-recipe "$py" benchmarks/train_step.py --bare --configs "${SPEED_RECIPE_CONFIGS:-bf16,fp8-delayed}" --batch 512 \
                    --seq 480 --prompt-tokens 224 --steps 20 --warmup 2 --profile "$out/profile" \
                    --out "$out/speed-recipe.json" ;;
    speed-recipe-unfused) part speed-recipe-unfused "$py" benchmarks/train_step.py --bare --configs bf16 \
                            --batch 512 --seq 480 --prompt-tokens 224 --steps 20 --warmup 2 \
                            --transformer apply_rope_fusion=false --out "$out/speed-recipe-unfused.json" ;;
    # Generation: the rollout manager against raw SGLang on the same prompts, the engine launched as a run launches
    # it (decode graphs sized to the batch), 20 interleaved rounds at 256 and 512 requests; then SGLang's own
    # graph size, 5 rounds at 512 (what sizing the graphs changes). ROLLOUT_REQUESTS picks the sizes (e.g. 512
    # alone when 256 was measured in a lease before).
    rollout) part rollout "$py" -u benchmarks/rollout_throughput.py --variants shipped --requests "${ROLLOUT_REQUESTS:-256,512}" \
               --repeats 20 --out "$out/rollout.json" ;;
    rollout-default) part rollout-default "$py" -u benchmarks/rollout_throughput.py --variants sglang-default \
                       --requests 512 --repeats 5 --out "$out/rollout-default.json" ;;
    # GRPO steps of the GSM8K shape, trainer and SGLang on one GPU: handing the GPU over, then both resident.
    # Steps 23 and 24 (one without a save, one with) run under the profiler, left out of the figures.
    # The hand-off moving the trainer's whole state every step (the benchmark's `--offload`; the recipe's own
    # setting is `needed`, below).
    colocated-0.5b) grpo_part colocated-0.5b "$py" "${grpo[@]}" --memory handoff --steps 24 --skip 2 \
                      --profile-push 23,24 --out "$out/colocated-0.5b.json" ;;
    # The same hand-off moving the trainer's state only as far as the engines need (trainer.offload.when=needed):
    # at 0.5B it stays on the card beside them (only the gradients freed), so no copy is on the push's path.
    colocated-0.5b-kept) grpo_part colocated-0.5b-kept "$py" "${grpo[@]}" --memory handoff --steps 24 --skip 2 \
                           --profile-push 23,24 --out "$out/colocated-0.5b-kept.json" trainer.offload.when=needed ;;
    resident-0.5b) grpo_part resident-0.5b "$py" "${grpo[@]}" --memory resident --steps 8 --skip 2 \
                     --out "$out/resident-0.5b.json" ;;
    colocated-7b) grpo_part colocated-7b "$py" "${grpo[@]}" --shape qwen2.5-7b --memory handoff \
                    --steps 3 --skip 1 --out "$out/colocated-7b.json" ;;
    # The 7B hand-off moving only what the engines need: the optimizer state leaves, the parameters stay.
    colocated-7b-kept) grpo_part colocated-7b-kept "$py" "${grpo[@]}" --shape qwen2.5-7b --memory handoff \
                         --steps 3 --skip 1 --out "$out/colocated-7b-kept.json" trainer.offload.when=needed ;;
    lora) lora_parts ;;
    # The 7B LoRA parts spend the memory LoRA saves on speed: no activation recompute (the full-parameter step
    # recomputes because its optimizer state fills the device) and the frozen base stays on the device while
    # the engine generates (its 15 GB would go out and back every step).
    # The 7B LoRA step pushing the adapters merged into the base (engines serve at base speed).
    lora-7b-merged) grpo_part lora-7b-merged "$py" "${grpo[@]}" --shape qwen2.5-7b --memory handoff --steps 3 \
                      --skip 1 --no-recompute --offload grads --out "$out/lora-7b-merged.json" trainer.lora.rank=16 trainer.lora.alpha=32 \
                      weight_sync.lora=merged ;;
    # Whether a colocated LoRA GRPO step of the whole Qwen2.5-7B fits, its time and memory.
    lora-7b) grpo_part lora-7b "$py" "${grpo[@]}" --shape qwen2.5-7b --memory handoff --steps 3 --skip 1 \
               --no-recompute --offload grads --out "$out/lora-7b.json" trainer.lora.rank=16 trainer.lora.alpha=32 ;;
    # The same step pushing the adapter inside the load request (/load_lora_adapter_from_tensors), no directory.
    lora-7b-tensors) grpo_part lora-7b-tensors "$py" "${grpo[@]}" --shape qwen2.5-7b --memory handoff --steps 3 \
                       --skip 1 --no-recompute --offload grads --out "$out/lora-7b-tensors.json" trainer.lora.rank=16 trainer.lora.alpha=32 \
                       weight_sync.lora=tensors ;;
    *) echo "unknown part $p (versions unit engine contract auth moe multiturn agent trainer recipe guard-0.5b guard-7b prefill-graphs" \
            "lora combinations colocated-0.5b colocated-0.5b-kept resident-0.5b colocated-7b colocated-7b-kept lora-7b lora-7b-merged" \
            "lora-7b-tensors speed-recipe" \
            "speed-recipe-unfused rollout rollout-default trainer-offload; or the preset: sitting)"
       failed=$((failed + 1)) ;;
  esac
done
exit "$failed"
