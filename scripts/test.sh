#!/usr/bin/env bash
# Runs every test: unit, integration and end-to-end, against a real kube-apiserver + etcd.
# Builds the control plane binaries first (cached outside the repo; the first build takes ~10 minutes).
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh --test integration -- control_plane::`);
# without any, the end-to-end upgrade suites also run a second time under vitistack's own
# KubernetesCluster CRD.
set -euo pipefail
cd "$(dirname "$0")/.."

# The real components the tests run besides the control plane, installed from Debian's packages when
# missing (quiet when present): Prometheus and promtool (tests/e2e/prometheus.rs, alert_gate.rs),
# Alertmanager (tests/e2e/silences.rs), podman and runc
# (tests/e2e/image.rs builds and runs the controller's image).
bash scripts/install-prometheus.sh >/dev/null
bash scripts/install-podman.sh >/dev/null
# SeaweedFS, the S3-compatible server of tests/e2e/etcd_snapshot.rs, built from the Go module proxy into
# the cache when missing (one line when present).
bash scripts/build-seaweedfs.sh >/dev/null

bin_dir=$(bash scripts/build-k8s-bins.sh | tail -n 1)
export TUC_K8S_BIN_DIR="$bin_dir"
echo "test control plane: $("$bin_dir/kube-apiserver" --version), etcd $("$bin_dir/etcd" --version | awk 'NR==1 {print $3}'), kubectl $("$bin_dir/kubectl" version --client -o json | sed -n 's/.*"gitVersion": "\([^"]*\)".*/\1/p' | head -n1)"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
if [[ $# -eq 0 ]]; then
  # The explorer runs on its own below, where its count of schedules and steps is printed.
  cargo test --workspace --locked -- --skip every_schedule_keeps_every_promise 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  echo
  echo "the explorer (crates/core/tests/explorer): seeded schedules on the core's lifecycle"
  cargo test --locked -p talos-upgrade-core --test explorer -- --nocapture 2>&1 | tee -a "$log"
  explorer_status=${PIPESTATUS[0]}
  [[ $explorer_status -eq 0 ]] || status=$explorer_status
else
  cargo test --workspace --locked "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
fi
# The upgrade suites of the end-to-end binary again, under vitistack's own KubernetesCluster CRD instead of
# the project's (the two cannot be installed in one API server, so a test world uses one; see
# tests/e2e/world.rs). deploy and prometheus install the project's CRD and are not run twice.
if [[ $# -eq 0 ]]; then
  suites=(talos_upgrade talos_1_14 coexistence talos_failures talos_bad_input talos_drain talos_ordering talos_refresh talos_stops talos_starts cluster_lifecycle kubernetes_upgrade chaos chaos_apiserver leader_election)
  filters=()
  for suite in "${suites[@]}"; do
    filters+=("$suite::")
  done
  echo
  echo "end-to-end suites under vitistack's KubernetesCluster CRD (TUC_E2E_CRD=vitistack)"
  TUC_E2E_CRD=vitistack cargo test --locked --test e2e -- "${filters[@]}" 2>&1 | tee -a "$log"
  vitistack_status=${PIPESTATUS[0]}
  [[ $vitistack_status -eq 0 ]] || status=$vitistack_status
fi
set -e

# One closing line for the whole run: cargo prints a result line per test binary, the last of which is
# often an empty doc-test binary.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed;?$/) p += $(i-1); if ($(i) ~ /^failed;?$/) f += $(i-1) } }
     END { printf "\ntests: %d passed, %d failed\n", p, f; if (p == 0) { print "no test ran" > "/dev/stderr"; exit 1 } }' "$log" || status=1
exit "$status"
