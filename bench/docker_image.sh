#!/usr/bin/env bash
# Build the hetero-node image where no base-image registry is reachable: a Debian bookworm + Python base made with
# debootstrap and `docker import` (once; cached by its tag), then this repository's Dockerfile on top of it, with the
# torch wheel this host's pip resolves (a CPU build here) served to the build from 127.0.0.1.
#   bash bench/docker_image.sh [TAG]        (default TAG: hetero-node:debian; needs root)
# Installs docker.io and debootstrap with apt-get if missing and starts dockerd if none answers (for machines
# without an init system that would). Environment: HETERO_NODE_DOCKER_BASE (the base's tag), TORCH_VERSION, and
# TORCH_INDEX_URL: the index the torch wheel comes from (default: the host pip's own configuration). The CUDA variant
# for GPU servers: TORCH_INDEX_URL=https://pypi.org/simple (PyPI's Linux wheel is the CUDA build; its nvidia-*
# libraries come from PyPI during the build).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${1:-hetero-node:debian}
BASE=${HETERO_NODE_DOCKER_BASE:-hetero-node-base:bookworm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
WORK=$(mktemp -d /tmp/hetero-docker.XXXXXX)
server=""
cleanup() {
    [ -z "$server" ] || kill "$server" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

say() { echo "docker_image: $*"; }

[ "$(id -u)" = 0 ] || { say "needs root (dockerd, debootstrap)"; exit 2; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)  # a docker client alone starts no daemon
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
        || { apt-get update -q >/dev/null \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
fi

if ! docker info >/dev/null 2>&1; then
    say "starting dockerd (log: /var/log/dockerd.log)"
    setsid dockerd >/var/log/dockerd.log 2>&1 </dev/null &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { say "dockerd did not start; see /var/log/dockerd.log"; exit 1; }
fi

# No buildx here: the classic builder, which builds this Dockerfile as it is.
export DOCKER_BUILDKIT=0

if docker image inspect "$BASE" >/dev/null 2>&1; then
    say "base $BASE: cached"
else
    start=$SECONDS
    say "base $BASE: debootstrap bookworm (a minute or two)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/root" "$MIRROR" \
        >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
    # The host's CA bundle, so that pip inside builds trusts what the host's pip trusts (e.g. a proxy's CA).
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/root/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$WORK/root/var/cache/apt/archives/"*.deb "$WORK/root/var/lib/apt/lists/"*
    tar -C "$WORK/root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' - "$BASE" >/dev/null
    rm -rf "$WORK/root"
    say "base $BASE: built in $((SECONDS - start)) s"
fi

# torch: the wheel this host's pip picks for torch==$TORCH_VERSION (its own configuration decides: a local CPU wheel
# here, PyPI's CUDA build elsewhere), served over loopback with a constraints file pinning it; `--network host` lets
# the build reach both.
# With TORCH_INDEX_URL, that index alone: the host's pip configuration (find-links, extra indexes) is set aside.
pip_env=()
index=()
[ -z "${TORCH_INDEX_URL:-}" ] || { pip_env=(-u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null); index=(--index-url "$TORCH_INDEX_URL"); }
env "${pip_env[@]}" "$PY" -m pip download -q --no-deps --only-binary=:all: "${index[@]}" -d "$WORK/wheels" \
    "torch==$TORCH_VERSION" 2>"$WORK/pip.log" \
    || { cat "$WORK/pip.log"; exit 1; }
wheel=$(basename "$(ls "$WORK"/wheels/torch-*.whl)")
echo "torch==$(echo "$wheel" | cut -d- -f2)" >"$WORK/wheels/constraints.txt"
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$WORK/wheels" >/dev/null 2>&1 &
server=$!
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done

previous=$(docker image inspect -f '{{.Id}}' "$TAG" 2>/dev/null || true)
start=$SECONDS
say "image $TAG: building from $BASE with $(cat "$WORK/wheels/constraints.txt") (log printed on failure)"
if ! docker build --network host \
    --build-arg BASE="$BASE" \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" \
    --build-arg PIP_CONSTRAINT="http://127.0.0.1:$port/constraints.txt" \
    --build-arg PIP_TRUSTED_HOST=127.0.0.1 \
    --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    -t "$TAG" . >"$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log"
    exit 1
fi
# The image this tag named before, untagged now: 1.6 GB a rebuild otherwise (refused, and kept, while in use).
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$TAG")" ]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
fi
grep -E "^torch .* from " "$WORK/build.log" | sed 's/^/docker_image: /' || true
say "image $TAG: built in $((SECONDS - start)) s, $(docker image ls --format '{{.Size}}' "$TAG")"
