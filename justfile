# Developer shortcuts; the scripts they call are what CI and the README use.

image := "ghcr.io/vitistack/talos-upgrade-controller"
version := `sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1`
# docker, or podman.
container_tool := env_var_or_default("CONTAINER_TOOL", "docker")

default:
    @just --list

# Start the demo: a real control plane on loopback (Ctrl-C to stop).
demo:
    bash scripts/demo.sh

# Run every test against a real kube-apiserver + etcd (extra arguments go to cargo test).
test *ARGS:
    bash scripts/test.sh {{ARGS}}

# Only the end-to-end tests: simulated Talos clusters upgraded by the in-process controller, the
# deploy/ manifests and RBAC, and a real Prometheus scraping the controller.
e2e:
    bash scripts/test.sh --test e2e

# Format the code.
fmt:
    cargo fmt --all

# Lint as CI does.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets --locked -- -D warnings

# Regenerate deploy/crd.yaml from crates/core/src/crd.rs (tests/integration/crd.rs fails when it is stale).
crd:
    cargo run --quiet --locked -p talos-upgrade-controller -- crd > deploy/crd.yaml

# Build the container image: a static release binary, then the Dockerfile (FROM scratch) around it.
# Tagged <image>:<version> and <image>:<version>-<content hash>; CONTAINER_TOOL=podman or docker.
image:
    CONTAINER_TOOL={{container_tool}} IMAGE={{image}} bash scripts/build-image.sh

# Install prometheus and promtool (Debian's package) for tests/prometheus.rs.
prometheus:
    bash scripts/install-prometheus.sh

# Build (or find in the cache) kube-apiserver, etcd and kubectl; prints their directory.
k8s-bins:
    bash scripts/build-k8s-bins.sh

# Everything CI runs.
ci:
    bash .ci/run

# Benchmark: N clusters of 5 simulated Talos nodes upgraded at once (docs/performance.md).
bench *ARGS:
    cargo build --release -p talos-upgrade-controller -p bench --bins
    cargo run --release -p bench -- {{ARGS}}
