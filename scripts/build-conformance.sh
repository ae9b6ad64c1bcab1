#!/usr/bin/env bash
# Builds the Talos API conformance checker (crates/sim/tests/conformance, a Go program on Talos's own client library)
# into a cache directory outside the repository, keyed by a hash of its sources and this script. A warm
# cache skips the build entirely. Prints the path of the binary as its last line of stdout.
#
# Usage: scripts/build-conformance.sh            # build if needed, print the binary's path
# Env:   TUC_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
src="$repo/crates/sim/tests/conformance"
cache_root=${TUC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller}

# Build with the installed Go only (never download a toolchain) and without VCS stamping, which would
# fail in a tree that is not a git checkout and would change the binary with every commit.
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false CGO_ENABLED=0

key=$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" "$0" | sha256sum | cut -c1-16)
out="$cache_root/conformance/$key"

log() { printf '[build-conformance %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -x "$out/conformance" ]]; then
  log "cached: $out/conformance"
  echo "$out/conformance"
  exit 0
fi

machinery=$(awk '$1 == "github.com/siderolabs/talos/pkg/machinery" {print $2}' "$src/go.mod" | head -n1)
log "cold build with talos machinery ${machinery:-?} into $out"
started=$(date +%s)

# The first build compiles gRPC and the Talos API packages: about two minutes with no output on 2 busy cores.
heartbeat() { while sleep 30; do log "still building..."; done; }

log "downloading modules"
(cd "$src" && go mod download)
log "building"
mkdir -p "$out"
tmp=$(mktemp "$out/conformance.partial.XXXXXX")
heartbeat &
hb=$!
trap 'kill "$hb" 2>/dev/null || true; rm -f "$tmp"' EXIT
if ! (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$tmp" .); then
  log "FAILED to build $src"
  exit 1
fi

# Publish with a rename, so a concurrent or interrupted run never sees a half-written binary.
mv -f "$tmp" "$out/conformance"
log "built in $(( $(date +%s) - started ))s: $out/conformance"
echo "$out/conformance"
