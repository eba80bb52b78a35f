# One image for both programs (edge-relay and cloud-ingest): slim, non-root, multi-arch (amd64/arm64:
# every dependency ships wheels for both).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY edge_relay edge_relay
COPY cloud_ingest cloud_ingest
COPY schemas schemas
COPY relay_common relay_common
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/edge-relay relay \
 && mkdir -p /var/lib/edge-relay /var/lib/cloud-ingest \
 && chown relay /var/lib/edge-relay /var/lib/cloud-ingest
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 10001
ENTRYPOINT ["edge-relay"]
CMD ["--help"]
