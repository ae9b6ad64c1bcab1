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
# Not root: the uid/gid of distroless's "nonroot", which deploy/ and the chart's securityContext name.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/talos-upgrade-controller"]
CMD ["run"]
