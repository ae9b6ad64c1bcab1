#!/usr/bin/env bash
# Builds the controller's container image: a fully static release binary (glibc, `+crt-static`), then
# the Dockerfile, which takes that binary and the CA roots from a small build context (nothing to pull:
# the image is FROM scratch). The same script serves people (`just image`, docker or podman) and CI and
# the image test (tests/e2e/image.rs), so the image CI runs is the image users build.
#
# Usage: scripts/build-image.sh             # build (if needed), print the image reference last
# Env:   CONTAINER_TOOL  podman (default when installed) or docker
#        IMAGE           repository (default: localhost/talos-upgrade-controller)
#        CARGO_TARGET_DIR as cargo reads it
#
# The tag is the crate version plus a hash of the binary and the Dockerfile, so an unchanged build is
# found already built and a changed one never reuses an old image. Podman runs with
# scripts/containers.conf (runc, low ulimits, host network) unless CONTAINERS_CONF says otherwise.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
log() { printf '[build-image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

tool=${CONTAINER_TOOL:-}
if [[ -z "$tool" ]]; then
  if command -v podman >/dev/null; then tool=podman; elif command -v docker >/dev/null; then tool=docker; fi
fi
if [[ -z "$tool" ]] || ! command -v "$tool" >/dev/null; then
  echo "build-image: neither podman nor docker is installed (scripts/install-podman.sh installs podman)" >&2
  exit 1
fi
if [[ "$tool" == podman ]]; then
  export CONTAINERS_CONF=${CONTAINERS_CONF:-$repo/scripts/containers.conf}
fi

# One static binary for the machine's own target. The flag goes to the target only (not to build
# scripts or proc macros), and the explicit --target keeps these artefacts apart from the test build's,
# so neither invalidates the other.
target=$(rustc -vV | sed -n 's/^host: //p')
# Run from `cargo test` (tests/e2e/image.rs), this script inherits the package variables cargo sets for a
# test process (CARGO_MANIFEST_DIR, CARGO_PKG_NAME, ...). ring's build script declares that it depends
# on those names (`rerun-if-env-changed`), and cargo compares them against its own environment, so
# their presence alone made ring, everything above it and the whole-program link build again inside
# the tests after CI's image step had just built them. Dropped here, every caller builds the same thing.
for name in $(compgen -e | grep -E '^(CARGO_(MANIFEST_[A-Z_]+|PKG_[A-Z_]+|CRATE_NAME|BIN_NAME|PRIMARY_PACKAGE)|OUT_DIR)$' || true); do
  unset "$name"
done
log "cargo build --release --target $target (static)"
export "CARGO_TARGET_$(echo "$target" | tr 'a-z-' 'A-Z_')_RUSTFLAGS=-C target-feature=+crt-static"
cargo build --release --locked --target "$target" --bin talos-upgrade-controller >&2
target_dir=${CARGO_TARGET_DIR:-$repo/target}
binary="$target_dir/$target/release/talos-upgrade-controller"

# Static means no program interpreter and no shared libraries: what the kernel needs to exec it in an
# image without a libc.
if readelf -l "$binary" | grep -q 'INTERP'; then
  echo "build-image: $binary asks for a program interpreter; it is not static" >&2
  exit 1
fi
if readelf -d "$binary" 2>/dev/null | grep -q '(NEEDED)'; then
  echo "build-image: $binary needs shared libraries: $(readelf -d "$binary" | grep NEEDED)" >&2
  exit 1
fi

# CA roots for the optional live release sources (--live-releases): the build machine's bundle.
ca=""
for candidate in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt /etc/ssl/cert.pem; do
  if [[ -s "$candidate" ]]; then ca=$candidate; break; fi
done
if [[ -z "$ca" ]]; then
  echo "build-image: no CA bundle found (install ca-certificates)" >&2
  exit 1
fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
key=$(cat "$binary" "$repo/Dockerfile" "$ca" | sha256sum | cut -c1-12)
image="${IMAGE:-localhost/talos-upgrade-controller}:${version}-${key}"

if "$tool" image inspect "$image" >/dev/null 2>&1; then
  log "already built: $image"
else
  context=$(mktemp -d)
  trap 'rm -rf "$context"' EXIT
  # Modes set here rather than with COPY --chmod, which Docker's legacy builder does not know.
  install -m 0555 "$binary" "$context/talos-upgrade-controller"
  install -m 0444 "$ca" "$context/ca-certificates.crt"
  log "$tool build $image"
  "$tool" build --quiet -f "$repo/Dockerfile" -t "$image" "$context" >&2
fi
# Also as :<version>, what deploy/ and the chart refer to.
"$tool" tag "$image" "${IMAGE:-localhost/talos-upgrade-controller}:${version}" >&2
log "size: $("$tool" image inspect --format '{{.Size}}' "$image") bytes"
echo "$image"
