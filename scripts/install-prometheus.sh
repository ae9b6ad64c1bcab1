#!/usr/bin/env bash
# Installs Prometheus and promtool from Debian's `prometheus` package when either is missing (the metrics
# tests in tests/prometheus.rs run both), then prints their versions. Idempotent and quiet: on a machine
# that has both it only prints the versions.
set -euo pipefail

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "prometheus/promtool missing and no apt-get here: install Prometheus (>= 2.42) so that both are on PATH" >&2
    exit 1
  fi
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "installing prometheus needs root (or sudo)" >&2; exit 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  log=$(mktemp)
  # Quiet unless something fails; then apt's own output says why.
  quiet() { "$@" >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; exit 1; }; }
  quiet "${sudo[@]}" apt-get update -qq
  # The package's postinst starts a prometheus service on :9090 where it can; the tests start their own
  # Prometheus, so forbid service starts for this install (policy-rc.d exit 101) unless a policy exists.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${sudo[@]}" chmod +x /usr/sbin/policy-rc.d
    trap '"${sudo[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  # --no-install-recommends: the server and promtool, not the exporters.
  quiet "${sudo[@]}" apt-get install -y -qq --no-install-recommends prometheus
  rm -f "$log"
fi

prometheus --version 2>&1 | head -1
promtool --version 2>&1 | head -1
