# The two commands: `make demo` and `make test`. Everything else is a step they depend on.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv data demo test test-long docker-test docker-test-cuda lint gpu-wheels gpu-check bench bench-long bench-long-wan bench-slow-link bench-plan bench-exchange bench-kills bench-agreement bench-byzantine bench-fuzz bench-fuzz-swarm bench-poison bench-sybil bench-admission bench-soak bench-nat bench-local-ranks sim sim-slow sim-slow-steps clean

# torch first, pinned: installing the project alone would let pip pick whatever torch build it resolves to.
venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

# The only networked step: the bundled corpus (sha256-verified), tokenized once into the cache.
data: venv
	$(BIN)/hetero-node data fetch

demo: venv data
	$(BIN)/hetero-node demo

test: venv data
	$(BIN)/python -m pytest -q -m "not long" --durations=15

# The slowest scenarios (a `small` model learning, six nodes settling at once, a killed stage being replaced), and
# those whose ground `make test` covers another way (loopback restarts and late joins, a second and third NAT case,
# a stage's resume, the 50 Mbit probe, a private swarm's round, a stock hivemind-dht as the entry point): each says
# which test covers it. About 20 min.
test-long: venv data
	$(BIN)/python -m pytest -q -m long --durations=15

# The Docker image, built from a debootstrap'd Debian base and run: a bootstrap and two joins in containers on a docker
# network train `tiny` and agree (root; installs docker.io and debootstrap if missing, starts dockerd; 3 to 5 min).
docker-test: venv
	HETERO_NODE_DOCKER_TEST=1 $(BIN)/python -m pytest -q -s -m docker tests/test_docker.py -k "not cuda" --durations=5

# The image's CUDA variant for GPU servers, built on the same base with PyPI's CUDA torch (about 3 GB more to fetch):
# a CUDA torch with NCCL in it, `join --devices` in its CLI (root; no GPU needed).
docker-test-cuda: venv
	HETERO_NODE_DOCKER_TEST=1 $(BIN)/python -m pytest -q -s -m docker tests/test_docker.py -k cuda --durations=5

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# What a GPU machine that has Python 3.12 with torch, numpy, scipy, typer, rich, safetensors, pyarrow, tokenizers and
# grpcio lacks, as py3.12 manylinux wheels (pinned to the versions the venv tested; pure-python ones as py3 wheels, built
# here when only an sdist exists), plus the project's own wheel and the bundled corpus's token cache (about 39 MB
# together, under the device tool's 64 MiB): `make gpu-check` there then needs no network. Wheels in .whl/, corpus in
# .cache/hetero-node (both git-ignored: hand them to the GPU machine with the working tree).
GPU_BINARY_WHEELS := hivemind==1.1.12 pydantic-core==2.50.5 cryptography==50.0.2 cffi==2.1.1 msgpack==1.2.4 \
	uvloop==0.23.0 PyYAML==6.0.4 psutil==7.2.2 blake3==1.0.11 mmh3==5.3.1 grpcio-tools==1.85.1 \
	protobuf==7.36.2
GPU_PURE_WHEELS := pydantic==2.14.4 typing-extensions==4.16.0 typing-inspection==0.4.5 annotated-types==0.8.0 \
	base58==2.1.1 py-multihash==3.0.0 varint==1.0.2 prefetch_generator==1.0.3 sortedcontainers==2.4.0 \
	ConfigArgParse==1.9.0 netaddr==1.3.0 idna==3.20 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0 morphys==1.0 \
	python-baseconv==1.2.2 six==1.17.0 pycparser==3.12 packaging==26.4 prometheus-client==0.26.0 tqdm==4.67.1
gpu-wheels: venv data
	mkdir -p .whl
	for spec in $(GPU_BINARY_WHEELS); do \
		$(BIN)/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
			--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
			--platform manylinux1_x86_64 -d .whl $$spec || exit 1; \
	done
	$(BIN)/python -m pip wheel --no-deps -w .whl $(GPU_PURE_WHEELS) .
	rm -rf .cache/hetero-node && mkdir -p .cache/hetero-node
	cp -r "$$($(BIN)/python -c 'from hetero_node.models.paths import default_cache_dir; print(default_cache_dir())')"/tokens \
		.cache/hetero-node/  # the token cache alone: the archive is read only to build it
	du -ch .whl/*.whl .cache/hetero-node | sort -h

# On one GPU: a CUDA member's outer step against a CPU member's, bit for bit (tests/test_outer_devices.py), the staged
# checkpoint (tests/test_checkpoint_devices.py), a node's local ranks over NCCL where it has 2 GPUs
# (tests/test_local_ranks.py), tokens/s and MFU per preset (compile on and off), and the demo swarm on
# 178m with and without --overlap (agreement, contributions, utilisation; H = 30, the run's default); figures in
# bench/results/gpu-check. About 8.5 min on an H200 by its parts' times (2026-11-27: device tests 56 s, 178m's tokens/s
# 54 s, the outer work 10 s, the swarm without --overlap 3.7 min, with it 3 min): near the device tool's 10-minute
# call limit, so give each mode its own call with GPU_CHECK_ARGS="--overlap-modes on" (or off).
# GPU_CHECK_ARGS="--presets 178m,1b" adds 1b's tokens/s.
# Where hivemind is missing, installs .whl/ into /tmp/site first (no network); uses .cache/hetero-node if present.
GPU_CHECK_ARGS ?=
gpu-check:
	if python3 -c "import hivemind, hetero_node" 2>/dev/null; then site=""; else \
		python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1; site=/tmp/site; fi; \
	if [ -d .cache/hetero-node ]; then export HETERO_NODE_CACHE="$$PWD/.cache/hetero-node"; fi; \
	export PYTHONPATH="$$site$${PYTHONPATH:+:$$PYTHONPATH}" PATH="$$site/bin:$$PATH"; \
	python3 -m pytest -q -p no:cacheprovider -rs tests/test_outer_devices.py tests/test_checkpoint_devices.py \
		tests/test_local_ranks.py -m 'not multipeer' && \
	python3 -m hetero_node.bench.gpu_check --out bench/results/gpu-check $(GPU_CHECK_ARGS)

# The benchmark scenarios (need root: network namespaces, CPU cgroups). hetero: all five methods on 2 datacenter and
# 2 edge nodes, 3 rounds x H = 10 (about 15 min on 2 cores, most of it ddp's dense all-reduce at 50 Mbit/s);
# mixed-speed: the same links with one full replica at a third of the others' speed, rounds overlapped (3 min).
bench: venv data
	$(BIN)/hetero-node-lab bench --topology hetero --preset small --rounds 3 --inner-steps 10 \
		--out bench/results/hetero
	$(BIN)/hetero-node-lab bench --topology mixed-speed --methods hetero --preset small --rounds 6 --inner-steps 10 \
		--overlap --out bench/results/mixed-speed

# One node's step on its local ranks against one process's on the same batches (README, "Several GPUs in one server"):
# two CPU ranks here (under a minute); on a multi-GPU server, LOCAL_RANKS_ARGS="--devices all --preset 178m".
LOCAL_RANKS_ARGS ?=
bench-local-ranks: venv
	$(BIN)/hetero-node-lab local-ranks $(LOCAL_RANKS_ARGS)

# Time to loss: ddp's budget is 6 x H = 20 steps, the swarm methods get 30 rounds; the report says when each first
# reached ddp's final eval loss (within 3%). tiny on the hetero links, the lab's batch and LR (about 25 min; root).
bench-long: venv data
	$(BIN)/hetero-node-lab bench --topology hetero-tiny --preset tiny --rounds 6 --swarm-rounds 30 --inner-steps 20 \
		--batch-size 8 --seq-len 64 --lr 3e-3 --out bench/results/hetero-long

# The same on links with 20-140 ms round trips (bench/topologies/hetero-tiny-wan.toml; delays need iptables).
bench-long-wan: venv data
	$(BIN)/hetero-node-lab bench --topology hetero-tiny-wan --preset tiny --rounds 6 --swarm-rounds 30 --inner-steps 20 \
		--batch-size 8 --seq-len 64 --lr 3e-3 --out bench/results/hetero-long-wan

# A home volunteer on a 5 Mbit/s, 150 ms link beside three datacenter replicas, against the same swarm with it on a
# datacenter link: its contribution share and the others' round lengths (bench/slow_link.py; about 8 min; root).
bench-slow-link: venv data
	$(BIN)/hetero-node-lab slow-link --out bench/results/slow-link

# The cost model's weak scaling from 10 to 1,000 volunteers (bench/swarms/volunteers-1000.toml; about 2.5 min).
bench-plan: venv
	$(BIN)/hetero-node-lab plan-scaling --out bench/results/plan-scaling

# Bytes a full replica downloads per round in loopback swarms of 2-16 tiny replicas, measured and modelled (~7 min).
bench-exchange: venv data
	$(BIN)/hetero-node-lab exchange --out bench/results/exchange-scaling

# The swarm CI's tests run (a bootstrap and 4 full replicas of tiny on 2 shards), 50 times in a row: rounds in which
# replicas disagree (goal 0), rounds aggregated without every replica, failed runs (about 65 min on 2 cores).
bench-agreement: venv data
	$(BIN)/hetero-node-lab agreement --out bench/results/agreement

# 20 SIGKILLs (with restarts) and 5 freezes of random peers of a local swarm (no root needed; about 7 min).
bench-kills: venv data
	$(BIN)/hetero-node-lab kills --out bench/results/kills

# Finite, well-formed attacks on the outer step under the mean and the robust rule (one process; about 30 min).
bench-byzantine: venv data
	$(BIN)/hetero-node-lab byzantine --seeds 2 --out bench/results/byzantine

# 10^5 structure-aware malformed inputs against every parser a peer's bytes reach, and extreme valid swarms against the planner (about 30 s).
bench-fuzz: venv
	$(BIN)/hetero-node-lab fuzz --out bench/results/fuzz

# 10^5 malformed stream messages, RPCs and DHT records sent by a peer process to a training local swarm (~13 min).
bench-fuzz-swarm: venv data
	$(BIN)/hetero-node-lab fuzz-swarm --out bench/results/fuzz-swarm

# A joiner among lying donors (other rounds, weights, fingerprints; real peers in one process; about 14 min).
bench-poison: venv
	$(BIN)/hetero-node-lab poison --out bench/results/poison

# Record-only identities (4,097 and 10^5, ids ground low) against an honest node's view and votes (one process, ~60 s).
bench-sybil: venv
	$(BIN)/hetero-node-lab sybil --out bench/results/sybil

# ~3 min: real swarms with and without a negating replica, with and without --admission loss
bench-admission: venv data
	$(BIN)/hetero-node-lab admission --out bench/results/admission

# One hour of a fault-free local swarm on 50 Mbit/s links (root; --link-mbit 0: loopback): RSS, fds, threads per
# peer, and what is left after SIGTERM.
bench-soak: venv data
	$(BIN)/hetero-node-lab soak --out bench/results/soak

# What a circuit relay costs: two replicas on 20 Mbit/s links, direct, then one, then both behind NAT routers (root; ~4 min).
bench-nat: venv data
	$(BIN)/hetero-node-lab nat --out bench/results/nat

# The algorithm lab: the paper's three findings on `tiny` (12 cells x 3 seeds in one process, no network; ~1 h).
sim: venv data
	$(BIN)/hetero-node-lab sim --out bench/results/sim

# The lab's slow replicas: 2 of 4 at a quarter speed, every round, once per 4 rounds, or sitting out, by rule (27 runs; estimated ~18 min from the 21-run sweep's 14).
sim-slow: venv data
	$(BIN)/hetero-node-lab sim --methods sparseloco --replicas 4 --slow-replicas 2 --slow-factor 4 \
		--slow-windows 0,1,4 --slow-rules plain,discounted,rescaled,rescaled-discounted,rebased --jobs 2 --out bench/results/sim-slow

# In a stretched round (the fast replicas' steps of 4 batches): 2 of 4 at a quarter, a tenth and a twentieth of the
# speed, fewer steps of the round's size or smaller ones, or sitting out (3 × 12 runs, about 1.5 h on 2 cores).
sim-slow-steps: venv data
	for f in 4 10 20; do $(BIN)/hetero-node-lab sim --methods sparseloco --replicas 4 --slow-replicas 2 --slow-factor $$f \
		--accumulation 4 --slow-windows 1,0 --slow-steps fewer,smaller --jobs 2 --out bench/results/sim-slow-steps/f$$f \
		|| exit 1; done

# Back to a fresh clone (the corpus cache under $$HETERO_NODE_CACHE is kept: it is not in the repository).
clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis protocol/_generated
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
