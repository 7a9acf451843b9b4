#!/usr/bin/env bash
# Join the state parts written by scripts/train_gpu.sh into the committed training state, and install
# the exported model next to the tokenizer:
#   bash scripts/join_state.sh DIR      # DIR holds tiny_train_state.pt.part* and tiny/
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: join_state.sh DIR (the folder train_gpu.sh wrote)}
ls "$DIR"/tiny_train_state.pt.part* >/dev/null
cat "$DIR"/tiny_train_state.pt.part* > scripts/tiny_train_state.pt.tmp
mv scripts/tiny_train_state.pt.tmp scripts/tiny_train_state.pt
cp "$DIR/tiny/config.json" "$DIR/tiny/model.safetensors" ecache_cli/data/tiny/
echo "joined: scripts/tiny_train_state.pt ($(stat -c %s scripts/tiny_train_state.pt) bytes); model in ecache_cli/data/tiny"
