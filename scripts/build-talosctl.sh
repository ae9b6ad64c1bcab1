#!/usr/bin/env bash
# Builds the real talosctl (github.com/siderolabs/talos/cmd/talosctl, from the Go module proxy) into a cache
# directory outside the repository, keyed by a hash of its wrapper module (go.mod with
# `tool github.com/siderolabs/talos/cmd/talosctl`, go.sum), this script and scripts/lib/go-build.sh, which
# builds it. A warm cache skips the build entirely. Two releases, each from its own wrapper module and
# under its own key:
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
# shellcheck source=lib/go-build.sh
source "$repo/scripts/lib/go-build.sh"

talos=$(awk '$1 == "github.com/siderolabs/talos" {print $2}' "$src/go.mod" | head -n1)
# No -X flags: the version talosctl reports (and compares node versions with) is embedded in the
# published machinery module (pkg/machinery/gendata/data/tag, "v1.14.1" or "v1.12.0").
go_build_cached "build-talosctl $release" talosctl "talosctl $talos" "$src" "$script" \
  github.com/siderolabs/talos/cmd/talosctl "-s -w"
