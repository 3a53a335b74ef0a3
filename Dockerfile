# hetero-node for datacenter participants: a PyTorch base + the project, corpus and protobuf modules baked in.
#   docker build -t hetero-node .
#   docker run --gpus all -p 31337:31337 -v hetero-data:/data hetero-node join --peers <multiaddr> \
#       --host 0.0.0.0 --port 31337 --identity /data/identity.key --checkpoint-dir /data/checkpoints
# BASE defaults to a CUDA PyTorch runtime, whose torch is used as it is. Any Debian-like base with python3 (>= 3.11)
# and its venv module works too; pip then installs torch, and pip's settings as build arguments say which one
# (bench/docker_image.sh builds so from a debootstrap'd Debian, pinning a CPU torch wheel with PIP_CONSTRAINT).
ARG BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE}

# pip's own settings, for builds that need them (a local wheel directory, a constraints file or URL, a proxy's CA
# bundle). Build arguments reach the RUN steps' environment only, not the image's (`docker history` lists them).
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CONSTRAINT
ARG PIP_TRUSTED_HOST
ARG PIP_CERT

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HETERO_NODE_CACHE=/data/cache \
    PATH=/opt/venv/bin:$PATH

WORKDIR /opt/hetero-node
COPY . .
# A venv, since a distribution's python refuses system-wide pip installs (PEP 668). It sees the base's packages, so
# on the CUDA base the base's torch satisfies the project's `torch>=2.3` and is not reinstalled.
RUN python3 -m venv --system-site-packages /opt/venv \
    && pip install . \
    && python -c "import torch; print('torch', torch.__version__, 'from', torch.__file__)"

# Build-time work, so a container trains offline and its package directory can stay read-only:
# the verified, tokenized bundled corpus (the non-root user's, in the same layer), and the generated protobuf modules.
RUN useradd --create-home --uid 1000 hetero \
    && hetero-node data fetch --cache-dir /data/cache \
    && chown -R hetero /data \
    && python -c "from hetero_node.protocol.proto_build import load_proto_module; load_proto_module('wire')"
USER hetero

# Identity, checkpoints and the cache. A named volume starts as a copy of the image's /data (corpus included).
VOLUME /data
# The P2P port of the README's docker example, and the HTTP port where `bootstrap` and `join` serve /metrics, /healthz
# and /readyz (HETERO_NODE_METRICS_PORT is their --metrics-port: change the port with it, so the check below follows).
ENV HETERO_NODE_METRICS_PORT=9100
EXPOSE 31337 9100
# Healthy while the node's p2p daemon runs (/healthz). The start period covers reading the run and loading the data,
# before a joining node serves HTTP. Commands that serve nothing (--help, train, data) report unhealthy.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('HETERO_NODE_METRICS_PORT', '9100') + '/healthz', timeout=8)"]

ENTRYPOINT ["hetero-node"]
CMD ["--help"]
