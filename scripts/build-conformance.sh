#!/usr/bin/env bash
# Builds the Talos API conformance checker (crates/sim/tests/conformance, a Go program on Talos's own client library)
# twice into a cache directory outside the repository, keyed by a hash of all its sources and this script:
# against machinery v1.12.0 (go.mod) and against machinery v1.14.1 (go114.mod, with the talos114 build tag
# adding the checks of Talos 1.14's surface). A warm cache skips the builds entirely. Prints one line per
# binary as the last two lines of stdout, `<machinery version> <path>`, v1.12.0 first:
#
#   v1.12.0 /root/.cache/talos-upgrade-controller/conformance/<key>/conformance
#   v1.14.1 /root/.cache/talos-upgrade-controller/conformance/<key>/conformance114
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

# Every input of either build: both module files, both sums, every Go source, this script.
key=$(cat "$src/go.mod" "$src/go.sum" "$src/go114.mod" "$src/go114.sum" "$src"/*.go "$0" | sha256sum | cut -c1-16)
out="$cache_root/conformance/$key"

log() { printf '[build-conformance %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The first build of each compiles gRPC and the Talos API packages: minutes with no output on 2 busy cores.
heartbeat() { while sleep 30; do log "still building..."; done; }

machinery_of() { awk '$1 == "github.com/siderolabs/talos/pkg/machinery" {print $2}' "$src/$1" | head -n1; }

# build MODFILE TAGS NAME: build the program against MODFILE (with build tags TAGS) into $out/NAME.
build() {
  local modfile=$1 tags=$2 name=$3
  if [[ -x "$out/$name" ]]; then
    log "cached: $out/$name"
    return
  fi
  log "cold build of $name with talos machinery $(machinery_of "$modfile") ($modfile) into $out"
  local started
  started=$(date +%s)
  log "downloading modules"
  (cd "$src" && go mod download -modfile="$modfile")
  log "building"
  mkdir -p "$out"
  tmp=$(mktemp "$out/$name.partial.XXXXXX")
  heartbeat &
  hb=$!
  if ! (cd "$src" && go build -modfile="$modfile" -tags="$tags" -trimpath -ldflags "-s -w" -o "$tmp" .); then
    log "FAILED to build $src with $modfile"
    exit 1
  fi
  kill "$hb" 2>/dev/null || true
  # Publish with a rename, so a concurrent or interrupted run never sees a half-written binary.
  mv -f "$tmp" "$out/$name"
  tmp=""
  log "built $name in $(( $(date +%s) - started ))s: $out/$name"
}

tmp="" hb=""
trap 'if [[ -n "$hb" ]]; then kill "$hb" 2>/dev/null || true; fi; if [[ -n "$tmp" ]]; then rm -f "$tmp"; fi' EXIT

build go.mod "" conformance
build go114.mod talos114 conformance114

echo "$(machinery_of go.mod) $out/conformance"
echo "$(machinery_of go114.mod) $out/conformance114"
