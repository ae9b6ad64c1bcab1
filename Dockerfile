# The controller's image: one static binary and the CA roots, nothing else (no shell, no libc, no
# package manager). Build it with `just image` or `bash scripts/build-image.sh`, which first builds the
# static release binary and puts it beside the CA bundle in the build context this file reads:
#
#   context/talos-upgrade-controller   cargo build --release with -C target-feature=+crt-static
#   context/ca-certificates.crt        the build machine's CA roots (for --live-releases)
#
# FROM scratch: nothing to pull, so it builds without a registry.
FROM scratch
COPY talos-upgrade-controller /talos-upgrade-controller
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
# rustls-native-certs reads this file; the variable makes the choice explicit.
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
# One glibc malloc arena for all threads: by default glibc gives each thread that meets a busy arena
# one of its own (up to 8 per core), and memory one thread frees stays in its arena for that thread
# (tasks move between the runtime's threads, and the blocking pool's threads allocate too). The peak
# RSS at 1,000 nodes was 3-4 MiB lower with one arena and its CPU the same, measured with two worker
# threads (docs/performance.md, Memory). glibc reads the variable at start-up,
# in this static binary too; `talos_upgrade_controller::IMAGE_ENV` and the benchmark use the same.
ENV MALLOC_ARENA_MAX=1
# Not root: the uid/gid of distroless's "nonroot", which deploy/ and the chart's securityContext name.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/talos-upgrade-controller"]
CMD ["run"]
