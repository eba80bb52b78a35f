# syntax=docker/dockerfile:1
# One image for both programs, edge-relay (the default entrypoint) and cloud-ingest
# (`--entrypoint cloud-ingest`). Slim, non-root (uid/gid 10001), no shell needed at run time,
# works with a read-only root file system (writes go to /var/lib/edge-relay, /var/lib/cloud-ingest
# and /tmp, which Kubernetes and docker-compose mount as volumes).
#
# Multi-arch: every dependency ships manylinux wheels for x86_64 and aarch64, so
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/kepler-edge-relay:TAG --push .
# builds both without a compiler. The build stage deliberately runs on the *target* platform (no
# --platform=$BUILDPLATFORM): pip picks binary wheels for the architecture it runs on.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY edge_relay edge_relay
COPY cloud_ingest cloud_ingest
COPY schemas schemas
COPY relay_common relay_common
COPY vendors vendors
# The simulator (`edge-relay simulate`, imported only by that subcommand) serves docker-compose.yml's demo.
COPY simulator simulator
# testkit/ (test, bench and demo tooling, a distribution of its own) is neither copied nor in the wheel.
# Wheels of the project and of every dependency, so the runtime stage installs offline.
RUN pip wheel --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kepler-edge-relay" \
      org.opencontainers.image.description="edge-relay (KubeEdge sidecar beside Kepler) and cloud-ingest (MQTT to Prometheus remote-write)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 relay \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/edge-relay --no-create-home \
      --shell /usr/sbin/nologin relay \
 && mkdir -p /var/lib/edge-relay /var/lib/cloud-ingest /etc/edge-relay /etc/cloud-ingest \
 && chown 10001:10001 /var/lib/edge-relay /var/lib/cloud-ingest
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels kepler-edge-relay
# Spool (edge) and dead-letter store (cloud); Kubernetes mounts volumes over both.
VOLUME ["/var/lib/edge-relay", "/var/lib/cloud-ingest"]
# edge-relay self-metrics / cloud-ingest self-metrics (set metrics.listen to 0.0.0.0:PORT)
EXPOSE 9901 9902
USER 10001:10001
ENTRYPOINT ["edge-relay"]
CMD ["run", "--config", "/etc/edge-relay/config.yaml"]
