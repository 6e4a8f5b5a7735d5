# syntax=docker/dockerfile:1
# A prefill or decode node: CUDA, torch and ONE KV transfer library (NIXL with UCX, or Mooncake's CUDA build: both
# install conflicting modules, so an image never has the two).
#   docker build -f deploy/images/engine.Dockerfile --build-arg KV_BACKEND=nixl -t tandem-engine:nixl .
#   docker build -f deploy/images/engine.Dockerfile --build-arg KV_BACKEND=mooncake -t tandem-engine:mooncake .
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG KV_BACKEND=nixl
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
# torch first, from the CUDA index: a bare requirement would pull another build
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY kvtransfer kvtransfer
COPY protos protos
COPY wire wire
COPY settings settings
COPY node_common node_common
COPY prefill_node prefill_node
COPY decode_node decode_node
COPY proxy proxy
COPY cluster cluster
COPY benchmark benchmark
RUN pip install --no-cache-dir . huggingface_hub==2.4.0
# the KV transfer library, CUDA builds (the kv-cpu extra is for CPU machines)
RUN case "${KV_BACKEND}" in \
      nixl) pip install --no-cache-dir nixl==1.5.1 nixl-cu13==1.5.1 ;; \
      mooncake) pip install --no-cache-dir mooncake-transfer-engine-cuda13==0.3.13.post1 ;; \
      *) echo "KV_BACKEND must be nixl or mooncake, got ${KV_BACKEND}" >&2; exit 1 ;; \
    esac

FROM ${CUDA_IMAGE}
ARG KV_BACKEND=nixl
LABEL org.opencontainers.image.title="tandem-engine" \
      org.opencontainers.image.description="Tandem prefill/decode node (CUDA, torch, one KV transfer library)"
ENV DEBIAN_FRONTEND=noninteractive
# libibverbs1 without recommends: the providers it recommends make UCX crash at exit where no RDMA device exists;
# RDMA nodes get their provider libraries from the device plugin's mounts or a derived image
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 libibverbs1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp TANDEM_KV_BACKEND=${KV_BACKEND}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp tandem
USER 10001:10001
EXPOSE 50051 9400
# `python -m prefill_node ...` or `python -m decode_node ...` (the chart and the compose file say which)
ENTRYPOINT []
CMD ["python", "-m", "prefill_node", "--help"]
