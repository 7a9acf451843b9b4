#!/usr/bin/env bash
# Train the embedded model on a lent GPU (continue a state, or a new run), in one call of under 10 minutes.
#
# Resumes the training state $TRAIN_STATE (default scripts/tiny_train_state.pt, git-ignored) when that
# file exists, else starts a new run; trains on CUDA for $TRAIN_MINUTES minutes of wall time, and
# writes under $OUT (the folder the device tool brings back):
#   tiny_train_state.pt.part00, .part01   the new state, split in 15 MB parts (the tool brings back
#                                          files of at most 16 MiB); join with scripts/join_state.sh
#   tiny/config.json, tiny/model.safetensors   the exported (EMA) model
#   train.log                              the run's log (JSONL records in train.jsonl)
# The state file given is never modified here: the new one goes to $OUT only. The device tool copies
# only files git tracks or does not ignore: name the state in its carry list to take it along.
#
#   bash scripts/train_gpu.sh                                     # on the GPU machine ($OUT set by the tool)
#   OUT=/tmp/o TRAIN_DEVICE=cpu TRAIN_STEPS=3 bash scripts/train_gpu.sh   # CPU smoke run (tests/test_training.py)
#
# Two phases (warmup-stable-decay): the stable LR first (--cooldown 0: a state that ended in a decay
# phase warms up again), then the last TRAIN_COOLDOWN_FRAC of the run (default 0.25; 0: none) decays
# the LR linearly (--cooldown N, N = that share of the steps, sized from the first phase's pace).
#
# Knobs (environment): TRAIN_MINUTES (default 7), TRAIN_STEPS (stop after this many new steps in all; 0: none),
# TRAIN_DEVICE (default cuda), TRAIN_BATCH_TOKENS (default: 16384 on cuda, the state's on cpu),
# TRAIN_WORKERS (data processes on cuda, default 8), TRAIN_ADAPT_MIN (curriculum eval interval on cuda,
# default 3), TRAIN_LR (default: the state's), TRAIN_STATE (default scripts/tiny_train_state.pt, a new run
# when that file does not exist; "none": a new run in any case), PYTHON;
# TRAIN_ARGS: more scripts/train_tiny.py flags for both phases, whitespace-separated (a new run's recipe).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the new state and model}"
PY=${PYTHON:-python3}
DEVICE=${TRAIN_DEVICE:-cuda}
MINUTES=${TRAIN_MINUTES:-7}
STEPS=${TRAIN_STEPS:-0}
STATE=${TRAIN_STATE:-scripts/tiny_train_state.pt}
FRAC=${TRAIN_COOLDOWN_FRAC:-0.25}
mkdir -p "$OUT/tiny"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
extra=()
if [ "$DEVICE" != cpu ]; then
    # a GPU eats batches faster than one process builds them: 8 worker processes build pools ahead;
    # the curriculum evaluates every 3 minutes (fast on a GPU) so a 7-minute call adapts twice
    extra+=(--batch-tokens "${TRAIN_BATCH_TOKENS:-16384}" --threads 4 --data-workers "${TRAIN_WORKERS:-8}"
            --adapt-every-min "${TRAIN_ADAPT_MIN:-3}")
elif [ -n "${TRAIN_BATCH_TOKENS:-}" ]; then
    extra+=(--batch-tokens "$TRAIN_BATCH_TOKENS")
fi
[ -n "${TRAIN_LR:-}" ] && extra+=(--lr "$TRAIN_LR")
read -r -a more <<< "${TRAIN_ARGS:-}"
extra+=("${more[@]}")

"$PY" -c '
import sys
for name, v, ok in (("TRAIN_COOLDOWN_FRAC", sys.argv[1], lambda x: 0 <= float(x) < 1),
                    ("TRAIN_MINUTES", sys.argv[2], lambda x: float(x) > 0), ("TRAIN_STEPS", sys.argv[3], lambda x: int(x) >= 0)):
    try:
        good = ok(v)
    except ValueError:
        good = False
    if not good:
        print(f"train_gpu: {name}={v!r}: use a fraction in [0, 1) for the decay share, minutes > 0, steps >= 0",
              file=sys.stderr)
        sys.exit(2)
' "$FRAC" "$MINUTES" "$STEPS"
if [ "$DEVICE" != cpu ]; then
    "$PY" - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"train_gpu: torch {torch.__version__} sees no CUDA device; TRAIN_DEVICE=cpu runs on the CPU")
print(f"train_gpu: torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
EOF
fi

if [ "$STATE" = none ]; then
    echo "train_gpu: TRAIN_STATE=none: a new run"
elif [ -f "$STATE" ]; then
    cp "$STATE" "$OUT/state.pt"
elif [ -n "${TRAIN_STATE:-}" ]; then
    echo "train_gpu: TRAIN_STATE=$STATE: no such file (TRAIN_STATE=none starts a new run)" >&2
    exit 1
else
    echo "train_gpu: no training state at $STATE: a new run"
fi
step_of() {  # the step a state file is at; 0 before the first save of a new run
    [ -f "$1" ] || { echo 0; return; }
    "$PY" -c 'import sys, torch; print(torch.load(sys.argv[1], map_location="cpu", weights_only=False)["step"])' "$1"
}
# phase 1 (stable LR): all the steps or minutes but the cooldown's share
read -r PHASES P1_STEPS P2_STEPS P1_MIN P2_MIN < <("$PY" -c '
import sys; steps, minutes, f = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
n2 = min(steps - 1, max(1, round(steps * f))) if steps and f > 0 else 0
print(1 if f <= 0 or (steps and not n2) else 2, steps - n2 if steps else 0, n2, minutes * (1 - f), minutes * f * 1.5)' \
    "$STEPS" "$MINUTES" "$FRAC")
start=0
[ "$STEPS" = 0 ] && start=$(step_of "$OUT/state.pt")  # to size the decay from phase 1's pace
train() {
    "$PY" scripts/train_tiny.py --state "$OUT/state.pt" --device "$DEVICE" --log "$OUT/train.jsonl" "${extra[@]}" "$@" \
        2>&1 | grep -v '^\[transformers\]' | tee -a "$OUT/train.log"
}
if [ "$PHASES" = 1 ]; then  # no decay phase
    train --cooldown 0 --minutes "$MINUTES" --max-new-steps "$STEPS" --export --out "$OUT/tiny"
else
    train --cooldown 0 --minutes "$P1_MIN" --max-new-steps "$P1_STEPS"
    if [ "$STEPS" = 0 ]; then  # size the decay from the pace of phase 1
        P2_STEPS=$("$PY" -c 'import sys; print(max(1, round(int(sys.argv[1]) * float(sys.argv[2]) / (1 - float(sys.argv[2])))))' \
            "$(( $(step_of "$OUT/state.pt") - start ))" "$FRAC")
    fi
    # phase 2 (decay): --cooldown N from where phase 1 stopped; the minutes are only a safety stop
    train --cooldown "$P2_STEPS" --max-new-steps "$P2_STEPS" --minutes "$P2_MIN" --export --out "$OUT/tiny"
fi
rm -f "$OUT/tiny/tokenizer.json" "$OUT/tiny/tokenizer_config.json" "$OUT/tiny/special_tokens_map.json"
split -b 15000000 -d "$OUT/state.pt" "$OUT/tiny_train_state.pt.part"
rm "$OUT/state.pt"
ls -l "$OUT" "$OUT/tiny"
