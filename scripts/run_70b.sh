#!/usr/bin/env bash
# Run a big model (a 70B on a single consumer GPU) in one command, then chat with it.
#
#   scripts/run_70b.sh MODEL_OR_PATH [--weights int8|int4] [--disk DIR] [offload chat flags...]
#
# MODEL_OR_PATH is a checkpoint directory or a Hugging Face Hub id (meta-llama/Llama-3.3-70B-Instruct;
# gated models need HF_TOKEN). The first start detects the GPU, RAM and disk, writes DIR/offload.yaml
# (edit it freely), converts the weights into DIR/store once, calibrates once, prints the plan and
# opens the chat. Later starts reuse all three. This script is `offload chat --auto`.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
model="$1"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"  # this checkout's offload, installed or not
exec env PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" python -m offload chat --auto "$model" "$@"
