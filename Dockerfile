# hetero-node for datacenter participants: CUDA PyTorch runtime + the project, corpus and protobuf modules baked in.
#   docker build -t hetero-node .
#   docker run --gpus all -p 31337:31337 -v hetero-data:/data hetero-node join --peers <multiaddr> \
#       --host 0.0.0.0 --port 31337 --identity /data/identity.key --checkpoint-dir /data/checkpoints
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HETERO_NODE_CACHE=/data/cache

WORKDIR /opt/hetero-node
COPY . .
# torch comes with the base image; the same install command as the README's.
RUN pip install .

# Build-time work, so a container trains offline and its package directory can stay read-only:
# the verified, tokenized bundled corpus, and the generated protobuf modules.
RUN hetero-node data fetch --cache-dir /data/cache \
    && python -c "from hetero_node.protocol.proto_build import load_proto_module; load_proto_module('wire')"

RUN useradd --create-home --uid 1000 hetero \
    && chown -R hetero /data
USER hetero

# Identity, checkpoints and the cache. A named volume starts as a copy of the image's /data (corpus included).
VOLUME /data
# The P2P port of the README's docker example.
EXPOSE 31337

ENTRYPOINT ["hetero-node"]
CMD ["--help"]
