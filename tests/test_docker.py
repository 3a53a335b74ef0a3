"""The Docker image, built and run: a bootstrap and two `join` nodes in containers on a user-defined docker network
train `tiny` for 2 rounds and agree; and its CUDA variant for GPU servers, built on the same base.

Building takes minutes, so `make test` skips it; `make docker-test` runs it (root: it may install docker.io and
debootstrap, start dockerd, and builds the image from a debootstrap'd Debian base, as bench/docker_image.sh says),
`make docker-test-cuda` the CUDA variant (a CUDA torch from PyPI: about 3 GB more to download).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import join_args, run_args

from hetero_node.bootstrap.config import BootstrapConfig
from hetero_node.bootstrap.join_line import JOIN_LINE
from hetero_node.client.cli.options import to_argv

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[1]
OPT_IN = "HETERO_NODE_DOCKER_TEST"
IMAGE = "hetero-node:docker-test"
CUDA_IMAGE = "hetero-node:docker-test-cuda"
CUDA_TORCH_INDEX = "https://pypi.org/simple"
"""PyPI's Linux torch wheel is the CUDA build (the host's own index may hold the CPU one)."""
LABEL = "hetero-node-docker-test"  # on every container, volume and network the test makes; leftovers are removed
ROUNDS = 2


def docker(*args: str, check: bool = True, timeout: float = 120.0) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited with {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


def inspect(container: str) -> dict[str, Any]:
    return json.loads(docker("inspect", container))[0]


def remove_leftovers() -> None:
    """Containers (with their anonymous /data volumes), volumes and networks of this test, from any run."""
    containers = docker("ps", "-aq", "--filter", f"label={LABEL}").split()
    if containers:
        docker("rm", "-f", "-v", *containers)
    for kind in ("volume", "network"):
        names = docker(kind, "ls", "-q", "--filter", f"label={LABEL}").split()
        if names:
            docker(kind, "rm", *names)


def skip_reason() -> str | None:
    if not os.environ.get(OPT_IN):
        return f"builds a docker image (minutes): run `make docker-test` (it sets {OPT_IN}=1)"
    if os.geteuid() != 0:
        return "needs root: dockerd, debootstrap and installing them"
    for tool, package in (("dockerd", "docker.io"), ("debootstrap", "debootstrap")):
        if shutil.which(tool) is None and shutil.which("apt-get") is None:
            return f"no {tool}, and no apt-get to install {package}"
    return None


def build_image(tag: str, **env: str) -> str:
    """`tag` built from a local Debian base (the script installs and starts what is missing); `env`: the script's
    settings (TORCH_INDEX_URL)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    start = time.monotonic()
    build = subprocess.run(
        ["bash", str(ROOT / "bench" / "docker_image.sh"), tag], capture_output=True, text=True, timeout=3000,
        env={**os.environ, **env},
    )  # fmt: skip
    print(build.stdout, end="")  # the script's few lines: base cached or built, torch, build time and image size
    assert build.returncode == 0, f"image build failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    print(f"docker test: image {tag} ready in {time.monotonic() - start:.0f} s")
    return tag


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    built = build_image(IMAGE)
    remove_leftovers()
    yield built
    remove_leftovers()


def logs(container: str) -> str:
    """A container's output, stdout and stderr interleaved as it wrote them (the node logs to stderr)."""
    result = subprocess.run(["docker", "logs", container], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return result.stdout


def wait_for_join_line(container: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = JOIN_LINE.search(logs(container))
        if match:
            return match.group(1)
        if not inspect(container)["State"]["Running"]:
            break
        time.sleep(1.0)
    raise AssertionError(f"the bootstrap printed no join line; its log:\n{logs(container)[-3000:]}")


def read_from_container(container: str, path: str) -> tuple[int, str]:
    """(owner uid, text) of a file in a container, running or exited (`docker cp` streams a tar)."""
    data = subprocess.run(["docker", "cp", f"{container}:{path}", "-"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.next()
        assert member is not None and member.isfile(), f"{container}:{path} is not a file"
        return member.uid, tar.extractfile(member).read().decode()


def round_records(text: str) -> dict[int, dict[str, Any]]:
    records = (json.loads(line) for line in text.splitlines() if line.strip())
    return {r["round"]: r for r in records if "header" not in r}


def assert_non_root_with_data_volume(container: str) -> None:
    info = inspect(container)
    assert info["Config"]["User"] not in ("", "root", "0"), f"{container} runs as {info['Config']['User']!r}"
    mounts = {m["Destination"]: m for m in info["Mounts"]}
    assert "/data" in mounts and mounts["/data"]["Type"] == "volume", f"{container} mounts: {info['Mounts']}"


def test_bootstrap_and_two_joins_in_containers_agree(image: str) -> None:
    tag = uuid.uuid4().hex[:8]
    network = f"hetero-test-{tag}"
    names = {"bootstrap": f"hetero-test-{tag}-bootstrap", **{f"r{i}": f"hetero-test-{tag}-r{i}" for i in range(2)}}
    # No -v: the image's VOLUME gives each container an anonymous /data volume, filled from the image (corpus).
    run = ["run", "-d", "--network", network, "--label", LABEL, "-e", "OMP_NUM_THREADS=1"]
    docker("network", "create", "--label", LABEL, network)
    start = time.monotonic()

    boot = names["bootstrap"]
    run_definition = run_args(ROUNDS)
    where = BootstrapConfig(host="0.0.0.0", identity=Path("/data/bootstrap.id"))  # all of the container's interfaces
    bootstrap = ["--log-level", "INFO", "bootstrap", *to_argv(where, explicit={"host"})]
    docker(*run, "--name", boot, image, *bootstrap, *run_definition)
    peers = wait_for_join_line(boot)
    # The bootstrap advertises its address on the docker network, not loopback.
    boot_ip = inspect(boot)["NetworkSettings"]["Networks"][network]["IPAddress"]
    assert re.match(rf"/ip4/{re.escape(boot_ip)}/tcp/31337/p2p/\w+$", peers), (peers, boot_ip)

    for i in range(2):  # the joins learn the run from the bootstrap; they listen on all of the container's interfaces
        node = join_args(peers, i, Path("/data"), host="0.0.0.0", port=31337, min_peers=2, device="cpu")
        docker(*run, "--name", names[f"r{i}"], image, *node)

    codes = {}
    for i in range(2):
        name = names[f"r{i}"]
        codes[name] = int(docker("wait", name, timeout=600).strip())
    print(f"docker test: {ROUNDS} rounds of tiny in containers took {time.monotonic() - start:.0f} s")
    for name, code in codes.items():
        assert code == 0, f"{name} exited with {code}; log:\n{logs(name)[-3000:]}"

    replicas = []
    for i in range(2):
        uid, text = read_from_container(names[f"r{i}"], f"/data/r{i}.jsonl")
        assert uid != 0, f"r{i} wrote its metrics as root"
        replicas.append(round_records(text))
    assert set(replicas[0]) == set(replicas[1]) == set(range(ROUNDS)), [sorted(r) for r in replicas]
    for t in range(ROUNDS):  # different data shards, so equal weights mean they averaged over the docker network
        assert replicas[0][t]["fingerprints"] == replicas[1][t]["fingerprints"], t
        print(f"docker test: round {t}: fingerprints agree {replicas[0][t]['fingerprints']}")
    assert any(r[t]["contributors"] == 2 for r in replicas for t in range(ROUNDS)), replicas

    # The image's HEALTHCHECK asks the bootstrap's /healthz on the metrics port the image sets by default.
    deadline = time.monotonic() + 120
    while (health := inspect(boot)["State"]["Health"])["Status"] != "healthy" and time.monotonic() < deadline:
        time.sleep(2.0)
    assert health["Status"] == "healthy", health

    # Non-root and /data a volume: every container; the still running bootstrap's process itself too.
    for name in names.values():
        assert_non_root_with_data_volume(name)
    assert docker("exec", boot, "id", "-u").strip() != "0"
    assert docker("exec", boot, "stat", "-c", "%u", "/proc/1").strip() != "0"  # the hetero-node process
    assert int(docker("exec", boot, "stat", "-c", "%u", "/data/bootstrap.id").strip()) != 0


JOIN_PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXa9QgKiSJ3BsqNHqHjRUpKBTKmu8Sf1sQXUXiNqBiLRK"
"""A well-formed join line nobody answers: the CUDA image refuses `--devices all` before dialing it."""
CUDA_PROBE = """
import torch, torch.distributed as dist
print("cuda", torch.version.cuda, "nccl", dist.is_nccl_available(), "gpus", torch.cuda.device_count())
"""


def test_the_cuda_image_holds_a_cuda_torch_with_nccl_and_trains_on_all_gpus() -> None:
    """The CUDA variant, on the project's own base: torch is a CUDA build with NCCL (what `join --devices all` needs on
    a multi-GPU server); without a GPU here, a node in it refuses `--devices all` with its one-line error."""
    tag = build_image(CUDA_IMAGE, TORCH_INDEX_URL=CUDA_TORCH_INDEX)
    probe = docker("run", "--rm", "--entrypoint", "python", tag, "-c", CUDA_PROBE, timeout=300)
    print(f"docker test: {probe.strip()}")
    assert re.search(r"^cuda \d+\.\d+ nccl True", probe), probe
    assert "--devices" in docker("run", "--rm", tag, "join", "--help", timeout=300)
    if "gpus 0" in probe:
        run = subprocess.run(
            ["docker", "run", "--rm", tag, "join", "--peers", JOIN_PEER, "--devices", "all"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode != 0 and "no CUDA device" in run.stderr, run.stderr[-2000:]
