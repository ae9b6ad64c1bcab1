#!/usr/bin/env bash
# Installs Prometheus and promtool from Debian's `prometheus` package, and Alertmanager from its
# `prometheus-alertmanager` package, when any is missing (the metrics and alert gate tests run
# Prometheus and promtool, tests/e2e/prometheus.rs; the silence tests run Alertmanager,
# tests/e2e/silences.rs), then prints their versions. Idempotent and quiet: on a machine that has all
# three it only prints the versions.
set -euo pipefail

packages=()
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  packages+=(prometheus)
fi
if ! command -v prometheus-alertmanager >/dev/null; then
  packages+=(prometheus-alertmanager)
fi
if ((${#packages[@]})); then
  # shellcheck source=lib/apt-install.sh
  source "$(dirname "$0")/lib/apt-install.sh"
  # Each package's postinst starts its service where it can (prometheus on :9090, alertmanager on
  # :9093); the tests start their own processes on free loopback ports with temporary storage, so no
  # service starts for this install. --no-install-recommends: the servers and promtool, not the
  # exporters.
  apt_install --no-service-starts "${packages[*]}" \
    "${packages[*]} missing and no apt-get here: install Prometheus (>= 2.42, with promtool) and Alertmanager (>= 0.25, as prometheus-alertmanager) so that all three are on PATH" \
    "${packages[@]}"
fi

prometheus --version 2>&1 | head -1
promtool --version 2>&1 | head -1
prometheus-alertmanager --version 2>&1 | head -1
