#!/usr/bin/env bash
# Installs Debian's podman with the runc runtime when podman or runc is missing (the image test,
# tests/e2e/image.rs, builds and runs the controller's image with them; see scripts/containers.conf for
# why runc and not crun), then prints their versions. Idempotent and quiet: on a machine that has both it
# only prints the versions.
set -euo pipefail

if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
  # shellcheck source=lib/apt-install.sh
  source "$(dirname "$0")/lib/apt-install.sh"
  # --no-install-recommends: podman and runc, not crun, slirp4netns or the rootless helpers.
  apt_install podman \
    "podman/runc missing and no apt-get here: install podman (>= 4) and runc so that both are on PATH" \
    podman runc
fi

podman --version
runc --version | head -1
