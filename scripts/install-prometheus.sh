#!/usr/bin/env bash
# Installs Prometheus and promtool from Debian's `prometheus` package when either is missing (the metrics
# tests in tests/prometheus.rs run both), then prints their versions. Idempotent and quiet: on a machine
# that has both it only prints the versions.
set -euo pipefail

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  # shellcheck source=lib/apt-install.sh
  source "$(dirname "$0")/lib/apt-install.sh"
  # The package's postinst starts a prometheus service on :9090 where it can; the tests start their own
  # Prometheus, so no service starts for this install. --no-install-recommends: the server and promtool,
  # not the exporters.
  apt_install --no-service-starts prometheus \
    "prometheus/promtool missing and no apt-get here: install Prometheus (>= 2.42) so that both are on PATH" \
    prometheus
fi

prometheus --version 2>&1 | head -1
promtool --version 2>&1 | head -1
