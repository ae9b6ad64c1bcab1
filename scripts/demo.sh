#!/usr/bin/env bash
# The quick-start demo: builds what it needs (with progress), starts a real control plane on loopback and
# prints how to use it. Stays up until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

bin_dir=$(bash scripts/build-k8s-bins.sh | tail -n 1)
export TUC_K8S_BIN_DIR="$bin_dir"
echo "building the demo ..." >&2
# cargo execs the demo in its place, so Ctrl-C reaches the demo and it cleans up.
exec cargo run --locked -p demo --bin tuc-demo
