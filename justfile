# Developer shortcuts; the scripts they call are what CI and the README use.

default:
    @just --list

# Start the demo: a real control plane on loopback (Ctrl-C to stop).
demo:
    bash scripts/demo.sh

# Run every test against a real kube-apiserver + etcd.
test *ARGS:
    bash scripts/test.sh {{ARGS}}

# Format the code.
fmt:
    cargo fmt --all

# Lint as CI does.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets --locked -- -D warnings

# Build (or find in the cache) kube-apiserver, etcd and kubectl; prints their directory.
k8s-bins:
    bash scripts/build-k8s-bins.sh

# Everything CI runs.
ci:
    bash .ci/run
