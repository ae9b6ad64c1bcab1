#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kube-controller-manager, kubectl, etcd) from the Go module proxy into a cache
# directory outside the repository, keyed by the wrapper modules' go.sum hashes. A warm cache skips the
# build entirely. Prints the directory holding the binaries as its last line of stdout.
#
# Usage: scripts/build-k8s-bins.sh            # build if needed, print the bin dir
# Env:   TUC_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
tools="$repo/crates/testenv/k8s-bins"
cache_root=${TUC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller}

# The Kubernetes and etcd versions are read from the wrapper modules so there is one source of truth.
k8s_version=$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$tools/apiserver/go.mod" | head -n1)
etcd_version=$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2}' "$tools/etcd/go.mod" | head -n1)
if [[ -z "$k8s_version" || -z "$etcd_version" ]]; then
  echo "build-k8s-bins: cannot read versions from $tools/*/go.mod" >&2
  exit 1
fi
key=$(cat "$tools/apiserver/go.mod" "$tools/apiserver/go.sum" "$tools/etcd/go.mod" "$tools/etcd/go.sum" \
  "$0" | sha256sum | cut -c1-16)
out="$cache_root/k8s-bins/${k8s_version}-etcd${etcd_version}-${key}"

log() { printf '[build-k8s-bins %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" && -x "$out/kubectl" && -x "$out/etcd" ]]; then
  log "cached: $out"
  echo "$out"
  exit 0
fi

mkdir -p "$out.partial"
export CGO_ENABLED=0
minor=${k8s_version#v1.}
minor=${minor%%.*}
version_pkg=k8s.io/component-base/version
ldflags="-s -w -X $version_pkg.gitVersion=$k8s_version -X $version_pkg.gitMajor=1 -X $version_pkg.gitMinor=$minor \
 -X $version_pkg.gitTreeState=clean"

# A cold build runs for many minutes with no output from `go build`; a heartbeat shows it is alive.
heartbeat() { while sleep 30; do log "still building ($1)..."; done; }

build() {
  local name=$1 dir=$2 pkg=$3 flags=$4 started
  started=$(date +%s)
  log "downloading modules for $name"
  (cd "$dir" && go mod download)
  log "building $name ($pkg)"
  heartbeat "$name" &
  local hb=$!
  if ! (cd "$dir" && go build -trimpath -ldflags "$flags" -o "$out.partial/$name" "$pkg"); then
    kill "$hb" 2>/dev/null || true
    log "FAILED to build $name"
    exit 1
  fi
  kill "$hb" 2>/dev/null || true
  log "built $name in $(( $(date +%s) - started ))s"
}

log "cold build of kube-apiserver, kube-controller-manager and kubectl $k8s_version and etcd $etcd_version into $out"
build etcd "$tools/etcd" go.etcd.io/etcd/server/v3 "-s -w"
build kube-apiserver "$tools/apiserver" k8s.io/kubernetes/cmd/kube-apiserver "$ldflags"
build kubectl "$tools/apiserver" k8s.io/kubernetes/cmd/kubectl "$ldflags"
# Only its disruption controller runs in tests: it computes PodDisruptionBudget status, which the eviction
# API consults when the controller drains a node.
build kube-controller-manager "$tools/apiserver" k8s.io/kubernetes/cmd/kube-controller-manager "$ldflags"

rm -rf "$out"
mv "$out.partial" "$out"
log "done: $out"
echo "$out"
