#!/usr/bin/env bash
# One prepared GPU check for a CUDA machine (each call budgeted < 10 min; steps 1-4 and 5-8 take about that
# each on one H100, see ECACHE_GPU_CHECK_STEPS below), what only a GPU can show first:
#   1. the equivalence checks on CUDA in bfloat16 (bench/gpu_equivalence.py: every policy forced to
#      refresh at every step == none, token for token; LLaDA and Dream; schedule and threshold decoding),
#      plus any tests marked `gpu` (pytest -m gpu);
#   2. eager vs compiled (--compile: CUDA graphs per shape bucket) on a ~1B-parameter random-weight
#      LLaDA-shaped model, batch 1 and 8, none and entropy: tokens/s side by side, compile seconds apart
#      (bench/compile_speed.py, 8 prompts x 512 tokens, gen 64, one round; at most 8 graphs, what batch 1's
#      and batch 8's buckets took in a padded CPU dry run, the sub-batches of refreshing rows included;
#      forwards beyond the cap run eager and are counted; compile.json, compile.log);
#   3. the speed comparison on the same checkpoint shape, prompt 1024, gen 256, block 32, with and
#      without threshold decoding (bench/gpu_speed.py -> ecache profile's measure());
#   4. batch size 16 on the same shape: tokens/s and speedup over none for none/dual/entropy, mean
#      latency, and the share of wall time spent outside forwards (16 prompts x 512 tokens, gen 128;
#      batch/gpu_speed_table.txt, batch/gpu_speed.json);
#   5. a ~1B-parameter random LLaDA-MoE (32 experts, top-4) beside its dense twin of the same active size:
#      none/dual/entropy tokens/s and the experts' share of a full and a partial forward
#      (bench/moe_speed.py; moe.log, whose last line is the JSON);
#   6. the same 1B shape with quantized weights (--quantize): bfloat16 vs int8 vs int4 vs fp8, none and
#      entropy tokens/s, weight bytes and CUDA peak memory (bench/quantize.py; quantize.log, last line JSON);
#   7. block diffusion: ~1B random SDAR- and LLaDA2-shaped models, the exact block cache beside none (their
#      answers identical in bfloat16 too), tokens/s and TPF per decoder, batch 1 and 8, and a cached step
#      beside a bare forward over its block (bench/block_speed.py; block.log, last line JSON);
#   8. serving: the ~1B random LLaDA (the embedded model's tokenizer, 4-shot list chat requests, 64 tokens)
#      behind the server's scheduler in one process, admission always (continuous batching), fcfs (static)
#      and auto side by side on the same seeded Poisson arrivals at 0.6x and 0.9x the static capacity
#      measured first (16 requests as one batch), 24 requests a pass, one pass each (bench/serve_sim.py;
#      serve_sim.log, last line JSON). Expectation (issue 53): a GPU step's time grows sub-linearly with
#      its rows, so continuous p95 <= 0.6x static's near capacity (the issue's R*; gpu_expectation in
#      the JSON), and auto's p50 and p95 <= 1.05x the better of the two (targets).
#   9. mixed steps as one forward: bench/merge_refresh.py (a step whose rows refresh in part as a partial
#      forward plus a full one, split, or as one forward, merged; merge_refresh.log) and step 8's serving
#      run again with --merge-refresh (serve_sim_merged.log): on a launch-bound GPU a second forward costs
#      about a step, and continuous batching runs 3.5-4x as many two-forward steps as static (CPU count).
# Each step's timeout is cut to the budget's time left, so the last steps are the ones a slow machine loses.
# ECACHE_GPU_CHECK_STEPS picks the steps and their order (default "1 2 3 4 5 6 7 8 9"). All nine outrun one
# 570 s call on an H100 (steps 5-8 alone took ~9 minutes): run "1 2 3 4" and "8 6 7 5" as two calls, or
# only the steps a previous run did not reach.
# Writes everything under $ECACHE_GPU_OUT (default: $OUT when set, else runs_out/gpu):
#   equivalence.json, equivalence.log, pytest_gpu.log, gpu_speed_table.txt, gpu_speed.json, speed.log,
#   batch/gpu_speed_table.txt, batch/gpu_speed.json, batch.log, compile.json, compile.log, moe.log,
#   quantize.log, block.log, serve_sim.log, serve_steps.jsonl, merge_refresh.log, serve_sim_merged.log
#   (more than the device tool's 8 files: tar them).
# Dry run of the CPU-runnable parts with a tiny model:
#   ECACHE_GPU_CHECK_SIZE=tiny ECACHE_GPU_CHECK_DEVICE=cpu ECACHE_GPU_CHECK_DTYPE=float32 bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
SIZE=${ECACHE_GPU_CHECK_SIZE:-1b}
DEVICE=${ECACHE_GPU_CHECK_DEVICE:-cuda}
DTYPE=${ECACHE_GPU_CHECK_DTYPE:-bfloat16}
DEST=${ECACHE_GPU_OUT:-${OUT:-runs_out/gpu}}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
# the bench scripts import ecache_cli from this checkout, installed or not
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
# the whole call ends within $ECACHE_GPU_CHECK_BUDGET seconds (default 570): each step's timeout is cut
# to the time left (a step cut short fails; the steps after it are skipped when under 20 s remain)
BUDGET=${ECACHE_GPU_CHECK_BUDGET:-570}
cap() {  # min(the step's own limit $1, seconds left), at least 1 (timeout 0 would mean no limit)
    local left=$(( start + BUDGET - $(date +%s) ))
    [ "$left" -lt 1 ] && left=1
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

"$PY" - "$DEVICE" <<'EOF' || exit 1
import sys, torch, ecache_cli
dev = sys.argv[1]
if dev.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device; set ECACHE_GPU_CHECK_DEVICE=cpu for a dry run")
name = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu"
print(f"gpu_check: ecache {ecache_cli.__version__}, torch {torch.__version__}, device {name}")
EOF

rc=0
step1() {
  echo "== 1. equivalence on $DEVICE in $DTYPE"
  timeout "$(cap 180)" "$PY" bench/gpu_equivalence.py --device "$DEVICE" --dtype "$DTYPE" --out "$DEST/equivalence.json" \
      2>&1 | tee "$DEST/equivalence.log" || rc=1
  if [ "$DEVICE" != cpu ]; then
      timeout "$(cap 120)" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$DEST/pytest_gpu.log"
      prc=${PIPESTATUS[0]}
      [ "$prc" = 0 ] || [ "$prc" = 5 ] || rc=1   # 5: no test is marked gpu yet
  fi
}

step2() {
  echo "== 2. eager vs compiled, batch 1 and 8: $SIZE random LLaDA on $DEVICE $DTYPE"
  [ "$(cap 300)" -ge 20 ] || { echo "gpu_check: no time left for step 2"; return; }
  timeout "$(cap 300)" "$PY" bench/compile_speed.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" --batch-sizes 1,8 \
      --n 8 --prompt-len "${ECACHE_GPU_BATCH_PROMPT:-512}" --gen-length 64 --policies none,entropy --max-graphs 8 --rounds 1 \
      --no-check --json "$DEST/compile.json" 2>&1 | grep -v '^{' | tee "$DEST/compile.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
}

step3() {
  echo "== 3. speed: $SIZE random LLaDA on $DEVICE $DTYPE"
  timeout "$(cap 300)" "$PY" bench/gpu_speed.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" --out "$DEST" \
      2>&1 | tee "$DEST/speed.log" || rc=1
}

step4() {
  echo "== 4. batch size 16: $SIZE random LLaDA on $DEVICE $DTYPE"
  timeout "$(cap 150)" "$PY" bench/gpu_speed.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" --modes plain \
      --batch-sizes 16 --prompts 16 --prompt-len "${ECACHE_GPU_BATCH_PROMPT:-512}" --gen-length 128 \
      --policies none,dual,entropy --out "$DEST/batch" 2>&1 | tee "$DEST/batch.log" || rc=1
}

step5() {
  echo "== 5. MoE beside dense: $SIZE random LLaDA-MoE on $DEVICE $DTYPE"
  [ "$(cap 120)" -ge 20 ] || { echo "gpu_check: no time left for step 5"; return; }
  timeout "$(cap 120)" "$PY" bench/moe_speed.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" --prompts 2 \
      --prompt-len "${ECACHE_GPU_BATCH_PROMPT:-512}" --gen-length 64 --policies none,dual,entropy,entropy:tau=3 \
      2>&1 | tee "$DEST/moe.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
}

step6() {
  echo "== 6. quantized weights: $SIZE random LLaDA on $DEVICE, bf16 vs int8 vs int4 vs fp8 (tokens/s, memory)"
  if [ "$(cap 150)" -ge 20 ]; then   # four processes each load the 1B checkpoint: ~100 s on an H100
    timeout "$(cap 150)" "$PY" bench/quantize.py --device "$DEVICE" --no-tiny --big --big-gen 64 --prompts 2 \
        --prompt-len 256 --configs bfloat16:none,bfloat16:int8,bfloat16:int4,bfloat16:fp8 \
        --work "$DEST/quant_ckpt" 2>&1 | tee "$DEST/quantize.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    rm -rf "$DEST/quant_ckpt"
  else
    echo "gpu_check: no time left for step 6"
  fi
}

step7() {
  echo "== 7. block diffusion: $SIZE random SDAR and LLaDA2 on $DEVICE $DTYPE, block vs none"
  if [ "$(cap 180)" -ge 20 ]; then   # SDAR alone took ~80 s on an H100
    timeout "$(cap 180)" "$PY" bench/block_speed.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" --prompts 8 \
        --batch-sizes 1,8 --prompt-len 256 --gen-length 64 2>&1 | tee "$DEST/block.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  else
    echo "gpu_check: no time left for step 7"
  fi
}

step8() {
  echo "== 8. serving: $SIZE random LLaDA on $DEVICE $DTYPE, admission always vs fcfs vs auto near capacity"
  if [ "$(cap 150)" -ge 40 ]; then   # writing and loading the 1B checkpoint takes ~20 s of it
    # on CUDA the CPU threads only write the checkpoint faster; a CPU dry run keeps one
    timeout "$(cap 150)" "$PY" bench/serve_sim.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
        --threads "$([ "$DEVICE" = cpu ] && echo 1 || echo 4)" --admission always,fcfs,auto --shots 4 \
        --max-tokens 64 --rates 0.6x,0.9x --n 24 --repeats 1 --steps-log "$DEST/serve_steps.jsonl" \
        2>&1 | tee "$DEST/serve_sim.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  else
    echo "gpu_check: no time left for step 8"
  fi
}

step9() {
  echo "== 9. mixed steps as one forward: $SIZE random LLaDA on $DEVICE $DTYPE, split vs merged; serving with the merge"
  if [ "$(cap 200)" -ge 40 ]; then
    timeout "$(cap 80)" "$PY" bench/merge_refresh.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
        --repeats 3 2>&1 | tee "$DEST/merge_refresh.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    # step 8's serving run again with every mixed step one forward (compare with serve_sim.log)
    timeout "$(cap 120)" "$PY" bench/serve_sim.py --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
        --threads "$([ "$DEVICE" = cpu ] && echo 1 || echo 4)" --admission always,fcfs,auto --shots 4 \
        --max-tokens 64 --rates 0.6x,0.9x --n 24 --repeats 1 --merge-refresh 2>&1 | tee "$DEST/serve_sim_merged.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  else
    echo "gpu_check: no time left for step 9"
  fi
}

# the steps to run, in the order given (default all, 1-9): a second call runs only what the first lost
for step in ${ECACHE_GPU_CHECK_STEPS:-1 2 3 4 5 6 7 8 9}; do
  case "$step" in [1-9]) "step$step" ;; *) echo "gpu_check: no step $step (steps are 1-9)"; exit 2 ;; esac
done
echo "gpu_check: done in $(( $(date +%s) - start )) s, status $rc; table in $DEST/gpu_speed_table.txt"
exit $rc
