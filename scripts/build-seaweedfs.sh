#!/usr/bin/env bash
# Builds the real SeaweedFS `weed` binary (github.com/seaweedfs/seaweedfs/weed, from the Go module proxy)
# into a cache directory outside the repository, keyed by a hash of its wrapper module (tests/seaweedfs:
# go.mod with `tool github.com/seaweedfs/seaweedfs/weed`, go.sum), this script and scripts/lib/go-build.sh,
# which builds it. A warm cache skips the build entirely. The etcd snapshot tests
# (tests/e2e/etcd_snapshot.rs) store snapshots in its S3 gateway (`weed mini`: master, volume, filer and
# S3 in one process, on 127.0.0.1 with a temporary data directory).
#
# SeaweedFS is a production object store with an S3-compatible gateway; it is a Go module, so it comes from
# the same Go module proxy as helm and talosctl, built the same way. Cold cost, measured on the 2-core
# machine while a CI run and a cargo build shared it: 43 s to download its modules, then 9 min 3 s
# wall (5 min 42 s user, 54 s system CPU) to build; a warm cache costs nothing.
#
# Prints the binary's path as the last line of stdout:
#
#   /root/.cache/talos-upgrade-controller/weed/<key>/weed
#
# Usage: scripts/build-seaweedfs.sh        # build if needed, print the binary's path
# Env:   TUC_CACHE_DIR  cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/talos-upgrade-controller)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
src="$repo/tests/seaweedfs"
# shellcheck source=lib/go-build.sh
source "$repo/scripts/lib/go-build.sh"

version=$(awk '$1 == "github.com/seaweedfs/seaweedfs" {print $2}' "$src/go.mod" | head -n1)
if [[ -z "$version" ]]; then
  echo "build-seaweedfs: cannot read the seaweedfs version from $src/go.mod" >&2
  exit 1
fi

go_build_cached build-seaweedfs weed "seaweedfs $version" "$src" "$0" github.com/seaweedfs/seaweedfs/weed "-s -w"
