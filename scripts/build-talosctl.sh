#!/usr/bin/env bash
# Builds the real talosctl (github.com/siderolabs/talos/cmd/talosctl, from the Go module proxy) into a cache
# directory outside the repository, keyed by a hash of its wrapper module (go.mod with
# `tool github.com/siderolabs/talos/cmd/talosctl`, go.sum) and this script. A warm cache skips the build
# entirely. Two releases, each from its own wrapper module and under its own key:
#
#   1.14  talosctl v1.14.1 (crates/sim/tests/talosctl), the default: it speaks both API generations the
#         simulator plays, LifecycleService for nodes on Talos >= 1.13 and the legacy MachineService.Upgrade
#         for older ones.
#   1.12  talosctl v1.12.0 (crates/sim/tests/talosctl-1.12): the release of the machinery the Go
#         conformance check uses (crates/sim/tests/conformance/go.mod); it knows only the legacy Upgrade.
#
# Prints the binary's path as the last line of stdout (with --all, one line per release, 1.14 last):
#
#   /root/.cache/talos-upgrade-controller/talosctl/<key>/talosctl
#
# Usage: scripts/build-talosctl.sh [1.14|1.12]   # build if needed, print the binary's path
#        scripts/build-talosctl.sh --all         # both releases
# Env:   TUC_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
script="$repo/scripts/$(basename "$0")"

case "${1:-1.14}" in
  --all)
    bash "$script" 1.12
    exec bash "$script" 1.14
    ;;
  1.14) release=1.14 src="$repo/crates/sim/tests/talosctl" ;;
  1.12) release=1.12 src="$repo/crates/sim/tests/talosctl-1.12" ;;
  *)
    echo "usage: $0 [1.14|1.12|--all]" >&2
    exit 2
    ;;
esac
cache_root=${TUC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller}

# Build with the installed Go only (never download a toolchain), without VCS stamping (which would fail
# in a tree that is not a git checkout and change the binary with every commit) and without cgo, as Talos
# builds its release talosctl.
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false CGO_ENABLED=0

# Every input of the build: the module file, its sums, this script.
key=$(cat "$src/go.mod" "$src/go.sum" "$script" | sha256sum | cut -c1-16)
out="$cache_root/talosctl/$key"
bin="$out/talosctl"

log() { printf '[build-talosctl %s %s] %s\n' "$release" "$(date +%H:%M:%S)" "$*" >&2; }

# A cold build compiles talosctl's whole dependency tree (Kubernetes client, gRPC, the Talos API, the
# cluster provisioners): minutes with no output on 2 busy cores.
heartbeat() { while sleep 30; do log "still building ($(( $(date +%s) - started ))s)..."; done; }

tmp="" hb=""
trap 'if [[ -n "$hb" ]]; then kill "$hb" 2>/dev/null || true; fi; if [[ -n "$tmp" ]]; then rm -f "$tmp"; fi' EXIT

if [[ -x "$bin" ]]; then
  log "cached: $bin"
else
  talos=$(awk '$1 == "github.com/siderolabs/talos" {print $2}' "$src/go.mod" | head -n1)
  log "cold build of talosctl $talos ($src) into $out"
  started=$(date +%s)
  log "downloading modules"
  (cd "$src" && go mod download)
  log "building"
  mkdir -p "$out"
  tmp=$(mktemp "$out/talosctl.partial.XXXXXX")
  heartbeat &
  hb=$!
  # No -X flags: the version talosctl reports (and compares node versions with) is embedded in the
  # published machinery module (pkg/machinery/gendata/data/tag, "v1.14.1" or "v1.12.0").
  if ! (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$tmp" github.com/siderolabs/talos/cmd/talosctl); then
    log "FAILED to build talosctl $talos from $src"
    exit 1
  fi
  kill "$hb" 2>/dev/null || true
  hb=""
  # Publish with a rename, so a concurrent or interrupted run never sees a half-written binary.
  mv -f "$tmp" "$bin"
  tmp=""
  log "built talosctl in $(( $(date +%s) - started ))s: $bin"
fi

echo "$bin"
