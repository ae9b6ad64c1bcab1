#!/usr/bin/env bash
# Installs Debian's podman with the runc runtime when podman or runc is missing (the image test,
# tests/e2e/image.rs, builds and runs the controller's image with them; see scripts/containers.conf for
# why runc and not crun), then prints their versions. Idempotent and quiet: on a machine that has both it
# only prints the versions.
set -euo pipefail

if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "podman/runc missing and no apt-get here: install podman (>= 4) and runc so that both are on PATH" >&2
    exit 1
  fi
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "installing podman needs root (or sudo)" >&2; exit 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  log=$(mktemp)
  # Quiet unless something fails; then apt's own output says why.
  quiet() { "$@" >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }; }
  quiet "${sudo[@]}" apt-get update -qq
  # --no-install-recommends: podman and runc, not crun, slirp4netns or the rootless helpers.
  quiet "${sudo[@]}" apt-get install -y -qq --no-install-recommends podman runc
  rm -f "$log"
fi

podman --version
runc --version | head -1
