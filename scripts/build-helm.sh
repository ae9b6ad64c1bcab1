#!/usr/bin/env bash
# Builds the real helm v3.22.0 (helm.sh/helm/v3/cmd/helm, from the Go module proxy) into a cache directory
# outside the repository, keyed by a hash of the wrapper module (tests/helm: go.mod with
# `tool helm.sh/helm/v3/cmd/helm`, go.sum), this script and scripts/lib/go-build.sh, which builds it. A
# warm cache skips the build entirely. The chart tests (tests/e2e/helm.rs) lint, render and install
# deploy/helm/talos-upgrade-controller with it.
# Prints the binary's path as the last line of stdout:
#
#   /root/.cache/talos-upgrade-controller/helm/<key>/helm
#
# Usage: scripts/build-helm.sh            # build if needed, print the binary's path
# Env:   TUC_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
src="$repo/tests/helm"
# shellcheck source=lib/go-build.sh
source "$repo/scripts/lib/go-build.sh"

helm=$(awk '$1 == "helm.sh/helm/v3" {print $2}' "$src/go.mod" | head -n1)
client_go=$(awk '$1 == "k8s.io/client-go" {print $2}' "$src/go.mod" | head -n1)
if [[ -z "$helm" || -z "$client_go" ]]; then
  echo "build-helm: cannot read the helm and client-go versions from $src/go.mod" >&2
  exit 1
fi
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

go_build_cached build-helm helm "helm $helm" "$src" "$0" helm.sh/helm/v3/cmd/helm "$ldflags"
