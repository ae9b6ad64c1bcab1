#!/usr/bin/env bash
# Builds the real helm v3.22.0 (helm.sh/helm/v3/cmd/helm, from the Go module proxy) into a cache directory
# outside the repository, keyed by a hash of the wrapper module (tests/helm: go.mod with
# `tool helm.sh/helm/v3/cmd/helm`, go.sum) and this script. A warm cache skips the build entirely. The
# chart tests (tests/e2e/helm.rs) lint, render and install deploy/helm/talos-upgrade-controller with it.
# Prints the binary's path as the last line of stdout:
#
#   /root/.cache/talos-upgrade-controller/helm/<key>/helm
#
# Usage: scripts/build-helm.sh            # build if needed, print the binary's path
# Env:   TUC_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
src="$repo/tests/helm"
cache_root=${TUC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller}

# Build with the installed Go only (never download a toolchain), without VCS stamping (which would fail
# in a tree that is not a git checkout and change the binary with every commit) and without cgo, as Helm
# builds its release binaries.
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false CGO_ENABLED=0

# Every input of the build: the module file, its sums, this script.
key=$(cat "$src/go.mod" "$src/go.sum" "$0" | sha256sum | cut -c1-16)
out="$cache_root/helm/$key"
bin="$out/helm"

log() { printf '[build-helm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# A cold build compiles helm's whole dependency tree (the Kubernetes client libraries, ORAS, kustomize's
# kyaml): minutes with no output on 2 busy cores.
heartbeat() { while sleep 30; do log "still building..."; done; }

tmp="" hb=""
trap 'if [[ -n "$hb" ]]; then kill "$hb" 2>/dev/null || true; fi; if [[ -n "$tmp" ]]; then rm -f "$tmp"; fi' EXIT

if [[ -x "$bin" ]]; then
  log "cached: $bin"
else
  helm=$(awk '$1 == "helm.sh/helm/v3" {print $2}' "$src/go.mod" | head -n1)
  client_go=$(awk '$1 == "k8s.io/client-go" {print $2}' "$src/go.mod" | head -n1)
  if [[ -z "$helm" || -z "$client_go" ]]; then
    echo "build-helm: cannot read the helm and client-go versions from $src/go.mod" >&2
    exit 1
  fi
  log "cold build of helm $helm ($src) into $out"
  started=$(date +%s)
  log "downloading modules"
  (cd "$src" && go mod download)
  log "building"
  mkdir -p "$out"
  tmp=$(mktemp "$out/helm.partial.XXXXXX")
  heartbeat &
  hb=$!
  # The -X flags of helm's Makefile for a release tag: `helm version` reports the tag, and the Kubernetes
  # version helm assumes offline (`helm template`, `helm lint`'s deprecation check) is the one its
  # client-go release targets (client-go v0.N.x -> Kubernetes v1.N).
  minor=${client_go#v0.}
  minor=${minor%%.*}
  ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$helm -X helm.sh/helm/v3/internal/version.metadata="
  ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
  done
  if ! (cd "$src" && go build -trimpath -ldflags "$ldflags" -o "$tmp" helm.sh/helm/v3/cmd/helm); then
    log "FAILED to build helm from $src"
    exit 1
  fi
  kill "$hb" 2>/dev/null || true
  hb=""
  # Publish with a rename, so a concurrent or interrupted run never sees a half-written binary.
  mv -f "$tmp" "$bin"
  tmp=""
  log "built helm in $(( $(date +%s) - started ))s: $bin"
fi

echo "$bin"
