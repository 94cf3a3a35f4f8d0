# syntax=docker/dockerfile:1.7
# Shoal's router image: `shoal router` and `shoal autoscaler` (the chart runs both from it). No torch, no replica
# engine: the core dependencies (aiohttp, uvloop, xxhash, pydantic, prometheus-client, redis, kubernetes) and the
# `tokenize` extra (tokenizers, jinja2), so `--tokenizer` works on a mounted model folder.
# Build from the repository root (see docker/README.md):
#   docker build -f docker/router.Dockerfile -t shoal/router:0.1.0 .
# Base images are pinned to exact releases; pin a digest with --build-arg PYTHON_IMAGE=python:3.12.8-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/shoal
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router/ router/
COPY autoscaler/ autoscaler/
# The wheel holds only the packages copied above; the build fails if anything pulled torch in.
RUN /opt/shoal/bin/pip install '.[tokenize]' \
 && if /opt/shoal/bin/pip show torch >/dev/null 2>&1; then echo "torch must not be in the router image" >&2; exit 1; fi \
 && /opt/shoal/bin/shoal router --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="shoal-router" \
      org.opencontainers.image.description="Shoal's cache-aware router and autoscaler" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed non-root uid, the one the Helm chart's podSecurityContext names.
RUN groupadd --system --gid 10001 shoal \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin shoal
COPY --from=build /opt/shoal /opt/shoal
ENV PATH=/opt/shoal/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8000 9090
ENTRYPOINT ["shoal"]
CMD ["router", "--host", "0.0.0.0", "--port", "8000"]
