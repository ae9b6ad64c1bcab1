# shellcheck shell=bash
# Sourced by scripts/build-helm.sh and scripts/build-talosctl.sh: one Go tool built from its wrapper module
# (a go.mod with `tool <package>`, its go.sum) into a cache directory outside the repository, keyed by a
# hash of the module file, its sums, the calling script and this file. A warm cache skips the build
# entirely; a cold one publishes the binary with a rename.
#
# Env: TUC_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller)

# Build with the installed Go only (never download a toolchain), without VCS stamping (which would fail
# in a tree that is not a git checkout and change the binary with every commit) and without cgo, as the
# tools' own release binaries are built.
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false CGO_ENABLED=0

go_build_lib=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
go_build_tmp="" go_build_hb=""
trap 'if [[ -n "$go_build_hb" ]]; then kill "$go_build_hb" 2>/dev/null || true; fi; if [[ -n "$go_build_tmp" ]]; then rm -f "$go_build_tmp"; fi' EXIT

# go_build_cached TAG NAME WHAT SRC SCRIPT PKG LDFLAGS
#
#   Builds the Go package PKG of the wrapper module SRC with `-ldflags LDFLAGS` into
#   $cache_root/NAME/<key>/NAME unless it is there already, and prints that path on stdout. SCRIPT is
#   the calling script (part of the key); WHAT names the build in the log (`helm v3.22.0`), TAG the log
#   lines (`build-helm`), which go to stderr.
go_build_cached() {
  local tag=$1 name=$2 what=$3 src=$4 script=$5 pkg=$6 ldflags=$7
  local cache_root=${TUC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller}
  # Every input of the build: the module file, its sums, the calling script, this file.
  local key
  key=$(cat "$src/go.mod" "$src/go.sum" "$script" "$go_build_lib" | sha256sum | cut -c1-16)
  local out="$cache_root/$name/$key"
  local bin="$out/$name"

  if [[ -x "$bin" ]]; then
    go_build_log "$tag" "cached: $bin"
    echo "$bin"
    return
  fi
  go_build_log "$tag" "cold build of $what ($src) into $out"
  local started
  started=$(date +%s)
  go_build_log "$tag" "downloading modules"
  (cd "$src" && go mod download)
  go_build_log "$tag" "building"
  mkdir -p "$out"
  go_build_tmp=$(mktemp "$out/$name.partial.XXXXXX")
  # A cold build compiles the tool's whole dependency tree (the Kubernetes client libraries, gRPC, ...):
  # minutes with no output on 2 busy cores.
  while sleep 30; do go_build_log "$tag" "still building ($(( $(date +%s) - started ))s)..."; done &
  go_build_hb=$!
  if ! (cd "$src" && go build -trimpath -ldflags "$ldflags" -o "$go_build_tmp" "$pkg"); then
    go_build_log "$tag" "FAILED to build $what from $src"
    exit 1
  fi
  kill "$go_build_hb" 2>/dev/null || true
  go_build_hb=""
  # Publish with a rename, so a concurrent or interrupted run never sees a half-written binary.
  mv -f "$go_build_tmp" "$bin"
  go_build_tmp=""
  go_build_log "$tag" "built $name in $(( $(date +%s) - started ))s: $bin"
  echo "$bin"
}

go_build_log() { printf '[%s %s] %s\n' "$1" "$(date +%H:%M:%S)" "$2" >&2; }
