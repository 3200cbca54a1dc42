#!/usr/bin/env bash
# A GPU sitting that outlives the shell that started it (a dropped ssh session, a command time limit), read back
# in pieces while it runs.
#
#   scripts/gpu_sitting.sh start RUN_DIR PART...     # `scripts/gpu_checks.sh RUN_DIR sitting` with these parts
#   scripts/gpu_sitting.sh wait RUN_DIR SECONDS DEST  # wait up to SECONDS for its end, then pack what it wrote
#
# `start` copies the tree to RUN_DIR.src (later edits of the checkout do not reach the running checks), unpacks
# JIT_CACHE (a jit-cache.tar.gz an earlier `wait` wrote: flashinfer/triton/deep_gemm kernels, so engines start
# without compiling them again) when set, and runs the checks detached. `wait` prints the progress and packs,
# whatever the state: DEST/summary.md, DEST/progress.log, DEST/res.tar.gz (logs, JSON, summaries, profiles;
# not the tests' temporary trees; the profiler traces, then the engines' logs, left out where it would pass 15 MB) and
# DEST/jit-cache.tar.gz (under 16 MB). Extra environment (PYTHONPATH, SPEED_RECIPE_CONFIGS, ...) passes through.
set -u
cmd=${1:?usage: gpu_sitting.sh start RUN_DIR PART... | wait RUN_DIR SECONDS DEST}
run=${2:?RUN_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
jit_dirs=("$HOME/.cache/flashinfer" "$HOME/.triton" "$HOME/.cache/deep_gemm" "$HOME/.cache/tvm-ffi")
case $cmd in
  start)
    shift 2
    [ $# -gt 0 ] || { echo "name the sitting's parts (scripts/gpu_checks.sh lists them)" >&2; exit 2; }
    rm -rf "$run.src" "$run" "$run.done" && mkdir -p "$run.src" "$run"
    tar -C "$here" --exclude=.git --exclude=.venv --exclude=.device -cf - . | tar -C "$run.src" -xf -
    if [ -n "${JIT_CACHE:-}" ]; then tar -xzf "$JIT_CACHE" -C / && echo "JIT cache unpacked from $JIT_CACHE"; fi
    SITTING_PARTS="$*" setsid nohup bash -c \
      "bash '$run.src/scripts/gpu_checks.sh' '$run' sitting; echo \"exit \$?\" > '$run.done'" \
      > "$run.progress.log" 2>&1 < /dev/null &
    echo "sitting started $(date +%T): $*" ;;
  wait)
    secs=${3:?SECONDS}; dest=${4:?DEST}
    end=$((SECONDS + secs)) excl=()
    while [ ! -f "$run.done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    cat "$run.progress.log"
    if [ -f "$run.done" ]; then cat "$run.done"; else echo "still running at $(date +%T)"; fi
    mkdir -p "$dest"
    cp "$run.progress.log" "$dest/progress.log"
    [ -f "$run/summary.md" ] && cp "$run/summary.md" "$dest/"
    # Everything but the tests' temporary trees; over 15 MB, without the profiler traces, then the engines' logs.
    for drop in "" "*.json.gz" "*.logs"; do
      excl+=(${drop:+--exclude="$drop"})
      tar -C "$run" -czf "$dest/res.tar.gz" --exclude='tmp-*' "${excl[@]}" .
      [ "$(stat -c %s "$dest/res.tar.gz")" -le 15000000 ] && break
      echo "res.tar.gz over 15 MB${drop:+ without $drop}"
    done
    jit=(); for d in "${jit_dirs[@]}"; do [ -d "$d" ] && jit+=("${d#/}"); done
    if [ ${#jit[@]} -gt 0 ]; then
      tar -C / -czf "$dest/jit-cache.tar.gz" "${jit[@]}"
      [ "$(stat -c %s "$dest/jit-cache.tar.gz")" -gt 16000000 ] && rm -f "$dest/jit-cache.tar.gz"
    fi
    ls -la "$dest" ;;
  *) echo "unknown command $cmd (start | wait)" >&2; exit 2 ;;
esac
