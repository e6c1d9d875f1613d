# syntax=docker/dockerfile:1.7
# The one tierckpt image: operator (tierckpt-operator), node replicator (tierckpt-replicator), ramdisk CSI
# node plugin (tierckpt-csi) and the CLI (tierckpt). Every Python dependency is pinned by constraints.txt.
#
#   docker build -t REGISTRY/tierckpt:0.1.0 .                                    # torch CPU build (default)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t ... .   # CUDA torch
#   docker build --build-arg BASE=my-registry/python:3.11-slim-hardened -t ... .  # another base
#
# BASE must provide python3.11 as /usr/local/bin/python3.11 (build and runtime stages share it, so the
# virtualenv copies across). The daemons never import torch at runtime; the CUDA build is for using the
# same image for training containers (CUDA libraries come from the torch wheels, the driver from the node).
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.11 -m venv /opt/tierckpt
ENV PATH=/opt/tierckpt/bin:$PATH
WORKDIR /src
COPY constraints.txt pyproject.toml README.md ./
# torch first, from the chosen index, at the version constraints.txt pins (2.13.0 matches 2.13.0+cpu).
RUN pip install -c constraints.txt --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple torch
COPY client client
COPY cli cli
COPY demo demo
COPY replicator replicator
COPY csi csi
COPY operator operator
RUN pip install -c constraints.txt ".[replicator,csi,operator]" \
 && python -c "import tierckpt, tierckpt_cli.app, tierckpt_replicator.daemon, tierckpt_csi.service, tierckpt_operator" \
 && find /opt/tierckpt -name '__pycache__' -prune -exec rm -rf {} +

FROM ${BASE}
LABEL org.opencontainers.image.title="tierckpt" \
      org.opencontainers.image.description="Multi-tier checkpointing for ML training on Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/tierckpt /opt/tierckpt
ENV PATH=/opt/tierckpt/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Non-root by default (the operator runs so). The DaemonSet sets runAsUser 0 where it must: the CSI
# container (mounts) and the replicator (reads every job's directory, with three capabilities only).
USER 65532:65532
WORKDIR /tmp
CMD ["tierckpt", "--help"]
