# syntax=docker/dockerfile:1
# Multi-stage build: compile with cargo (dependencies cached in their own
# layer), run from a slim image as a non-root user.

FROM rust:1-slim-bookworm AS build
WORKDIR /src
# Dependency layer: build against stub sources so this layer is reused
# until Cargo.toml/Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked --features otel \
    && rm -rf src target/release/deps/*idemgate* target/release/.fingerprint/idemgate-* target/release/idemgate*
COPY src ./src
COPY config ./config
RUN cargo build --release --locked --features otel && strip target/release/idemgate

FROM debian:bookworm-slim AS runtime
# Set by the release workflow (.github/workflows/release.yml).
ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="idemgate" \
      org.opencontainers.image.description="An idempotency reverse proxy: makes configured HTTP routes safe to retry" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
# Unpinned on purpose: a rebuild picks up Debian's security fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 idemgate \
    && useradd --system --uid 10001 --gid idemgate --home-dir /var/lib/idemgate --create-home idemgate \
    && mkdir -p /etc/idemgate /var/lib/idemgate/data \
    && chown -R idemgate:idemgate /var/lib/idemgate
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY config/docker.toml /etc/idemgate/idemgate.toml
# Numeric, so the kubelet can check `runAsNonRoot` (it refuses a named user).
USER 10001:10001
WORKDIR /var/lib/idemgate
ENV IDEMGATE_CONFIG=/etc/idemgate/idemgate.toml
# 8080: proxied traffic. 9901: admin (/healthz, /readyz, /metrics).
EXPOSE 8080 9901
# Shell form: `|| exit 1` maps every curl failure to Docker's "unhealthy".
# hadolint ignore=DL3025
HEALTHCHECK --interval=10s --timeout=2s --start-period=5s --retries=3 \
    CMD curl -fsS http://127.0.0.1:9901/healthz || exit 1
STOPSIGNAL SIGTERM
ENTRYPOINT ["idemgate"]
CMD ["serve", "--config", "/etc/idemgate/idemgate.toml"]
