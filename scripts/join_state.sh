#!/usr/bin/env bash
# Join the state parts written by scripts/train_gpu.sh into one training state file, and install the
# exported model next to the tokenizer:
#   bash scripts/join_state.sh DIR [STATE]   # DIR holds tiny_train_state.pt.part* and tiny/;
#                                            # STATE defaults to scripts/tiny_train_state.pt (git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: join_state.sh DIR [STATE] (DIR: the folder train_gpu.sh wrote)}
STATE=${2:-scripts/tiny_train_state.pt}
ls "$DIR"/tiny_train_state.pt.part* >/dev/null
cat "$DIR"/tiny_train_state.pt.part* > "$STATE.tmp"
mv "$STATE.tmp" "$STATE"
cp "$DIR/tiny/config.json" "$DIR/tiny/model.safetensors" ecache_cli/data/tiny/
echo "joined: $STATE ($(stat -c %s "$STATE") bytes); model in ecache_cli/data/tiny"
