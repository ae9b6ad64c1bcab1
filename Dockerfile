# Multi-stage build of the controller as a static (musl) binary on a minimal, non-root base image.
# Build: docker build -t talos-upgrade-controller .
FROM rust:1.95-bookworm AS build
RUN rustup target add x86_64-unknown-linux-musl && apt-get update && apt-get install -y --no-install-recommends musl-tools
WORKDIR /src
COPY . .
RUN cargo build --release --locked --target x86_64-unknown-linux-musl --bin talos-upgrade-controller \
 && cp target/x86_64-unknown-linux-musl/release/talos-upgrade-controller /talos-upgrade-controller

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /talos-upgrade-controller /talos-upgrade-controller
USER 65532:65532
ENTRYPOINT ["/talos-upgrade-controller"]
