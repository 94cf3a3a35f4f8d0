# syntax=docker/dockerfile:1.7
# Shoal's replica image: `shoal replica` on a GPU, with torch (CUDA 13.0 wheels, which bring their own CUDA
# libraries and Triton) on the CUDA base image. Build from the repository root (see docker/README.md):
#   docker build -f docker/replica.Dockerfile -t shoal/replica:0.1.0 .
# Base images are pinned to exact releases; pin a digest with --build-arg CUDA_IMAGE=nvidia/cuda:...@sha256:...
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
# torch first, from the CUDA index, in its own layer: it is most of the image and changes least often.
RUN python3 -m venv /opt/shoal \
 && /opt/shoal/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
# The replica uses router.policy.hashing (the one block hash of the project), so the router package comes too.
COPY router/ router/
COPY replica/ replica/
RUN /opt/shoal/bin/pip install ".[replica]" \
 && /opt/shoal/bin/python -c "import torch, triton; assert torch.version.cuda, 'a CPU build of torch'; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
 && /opt/shoal/bin/shoal replica --help >/dev/null

FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="shoal-replica" \
      org.opencontainers.image.description="Shoal's MoE serving engine (NVFP4 experts, prefix-cached paged KV)" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG DEBIAN_FRONTEND=noninteractive
# Triton builds a small C launcher for each kernel on first use: it needs a C compiler and Python's headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# A fixed non-root uid, the one the Helm chart's podSecurityContext names.
RUN groupadd --system --gid 10001 shoal \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/shoal --shell /usr/sbin/nologin shoal
COPY --from=build /opt/shoal /opt/shoal
ENV PATH=/opt/shoal/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/shoal
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["shoal"]
CMD ["replica", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda", "--dtype", "bfloat16"]
