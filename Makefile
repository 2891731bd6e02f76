# Two commands do everything on a fresh machine: `make synth` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
CDK := node_modules/.bin/cdk
# cdk.json runs `python3 app.py`: the project venv comes first on PATH, then the project's own
# Node.js LTS (package.json pins it: Node 20 reached its end of life on 2026-10-30).
export PATH := $(CURDIR)/.venv/bin:$(CURDIR)/node_modules/.bin:$(PATH)
# Quiet, offline CLI: no telemetry, no notices.
export AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED := true
export CDK_DISABLE_CLI_TELEMETRY := true
# The CLI ignores CDK_DEFAULT_REGION without credentials; AWS_REGION is what it reads.
export AWS_REGION ?= us-east-2
GPTOSS := .venv/bin/gptoss
# The cluster a target acts on: CDK_ARGS="-c config=examples/production-3p8d.yaml" (or -c KEY=VALUE ...).
CDK_ARGS ?=
# deploy keeps CDK's approval prompt for IAM and security-group changes; CI passes
# DEPLOY_ARGS="--require-approval never". destroy asks unless YES=1.
DEPLOY_ARGS ?=
YES ?=
NODE_MAJOR := 22

.PHONY: setup synth plan local local-down test test-vm vm-root lint bootstrap deploy destroy diff bench-scale bench-synth bench-rollout bench-ready bench-proxy bench-policy bench-health diagrams clean

setup: .make/python .make/node .make/system .make/hf-clients .make/aws-cli .make/router-wheel

.make/python: pyproject.toml
	@mkdir -p .make
	@echo "setup: the pinned Python packages into .venv (pip; about 2 min the first time on a 2-core machine)"
	@test -x $(PY) || python3 -m venv .venv
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

.make/node: package.json package-lock.json
	@mkdir -p .make
	@echo "setup: the pinned CDK CLI and Node.js into node_modules (npm ci; about 10 s)"
	@npm ci --no-audit --no-fund --loglevel=error
	@v=$$(node_modules/.bin/node -p 'process.versions.node.split(".")[0]'); \
	if [ "$$v" -lt $(NODE_MAJOR) ]; then echo "node_modules/.bin/node is Node $$v; the CDK needs Node $(NODE_MAJOR) or 24 LTS (npm ci installs it from package.json)"; exit 1; fi
	@touch $@

# The staging tests run the node's download against each huggingface_hub major release the
# DLAMI's venv may hold (tests never reach PyPI: they are installed here).
HF_CLIENTS := 0.36.2 1.33.0 2.4.0
.make/hf-clients: .make/python Makefile
	@echo "setup: huggingface_hub $(HF_CLIENTS) into .hf-clients (the staging tests run each; about 15 s)"
	@for v in $(HF_CLIENTS); do test -d .hf-clients/$$v || $(PY) -m pip install --quiet --target .hf-clients/$$v huggingface_hub==$$v; done
	@touch $@

# The AWS CLI the nodes run (v1, as in the VM guest), in a folder of its own (it pins its own
# botocore): the compile-cache tests run the node's scripts with it against a moto server.
AWS_CLI := 1.46.3
.make/aws-cli: .make/python Makefile
	@echo "setup: the AWS CLI $(AWS_CLI) into .aws-cli (the nodes' scripts run with it in tests; about 10 s)"
	@test -d .aws-cli/$(AWS_CLI) || $(PY) -m pip install --quiet --target .aws-cli/$(AWS_CLI) awscli==$(AWS_CLI)
	@touch $@

# vLLM's router for the nodes: the spec's pinned wheel, checked against its sha256 (the stack ships it).
.make/router-wheel: .make/python clusterspec/sections/proxy.py scripts/fetch_router_wheel.py
	@echo "setup: vLLM's router wheel, checked against the spec's sha256"
	@$(PY) -m scripts.fetch_router_wheel
	@touch $@

# systemd-analyze checks the rendered units, curl runs the wait helper in tests, Graphviz
# draws `plan --diagram`, git and xz are what the nodes use too; HAProxy is the router nodes' API gate (its tests run the real one).
SYSTEM_TOOLS := systemd-analyze:systemd curl:curl dot:graphviz git:git xz:xz-utils haproxy:haproxy
.make/system:
	@mkdir -p .make
	@missing=$$(for t in $(SYSTEM_TOOLS); do command -v $${t%%:*} >/dev/null || echo $${t#*:}; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

# The VM scenarios (tests/vm): QEMU, an image builder and a NoCloud seed writer from Debian.
VM_TOOLS := qemu-system-x86_64:qemu-system-x86 qemu-img:qemu-utils mmdebstrap:mmdebstrap cloud-localds:cloud-image-utils ssh:openssh-client mkfs.ext4:e2fsprogs socat:socat
.make/vm-system:
	@mkdir -p .make
	@missing=$$(for t in $(VM_TOOLS); do command -v $${t%%:*} >/dev/null || echo $${t#*:}; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

# Where `make synth` writes the cloud assembly (a test points it elsewhere: two runs on one machine never share one).
CDK_OUT ?= cdk.out
synth: setup
	rm -rf $(CDK_OUT)
	$(CDK) synth --no-notices --quiet --output $(CDK_OUT) $(CDK_ARGS)
	@echo "templates:" && ls -1 $(abspath $(CDK_OUT))/*.template.json
	$(GPTOSS) plan $(CDK_ARGS)

plan: setup
	$(GPTOSS) plan $(CDK_ARGS)

# Against AWS (your credentials) or, with AWS_ENDPOINT_URL set, a local endpoint.
bootstrap: setup
	$(CDK) bootstrap --no-notices $(CDK_ARGS)

deploy: setup
	$(GPTOSS) deploy $(CDK_ARGS) $(DEPLOY_ARGS)

diff: setup
	$(GPTOSS) diff $(CDK_ARGS)

destroy: setup
	$(GPTOSS) destroy $(CDK_ARGS) $(if $(YES),--yes)

# The whole lifecycle on this machine, no AWS account: moto on localhost:5005 (GPTOSS_LOCAL_PORT),
# seeded, the CDK bootstrapped, examples/local.yaml deployed, its status shown; local-down removes
# it all and lists what is left (cluster_ops/local.py).
local: setup
	$(GPTOSS) local up

local-down: setup
	$(GPTOSS) local down

# Test files run in parallel (a file's fixtures stay in one worker). Three workers even on two
# cores: tests that wait on a subprocess or a timeout would leave a core idle. The 15 slowest
# tests are printed.
# Its report is checked like CI's VM report (scripts/check_junit.py): a skipped test fails make test,
# and so does a whole run of fewer than MIN_TESTS (a module lost at collection).
MIN_TESTS := 800
# Its CPU time is printed at the end (scripts/cpu_guard.py): the project keeps it under the target; a run
# past the ceiling fails (the ceiling leaves room for this shared machine's slower days; lower it toward
# the target as the suite gets there).
TEST_CPU_TARGET_S := 600
TEST_CPU_CEILING_S := 1800
test: setup
	@report=$$(mktemp --suffix=.xml); \
	$(PY) scripts/cpu_guard.py --label "make test" --target $(TEST_CPU_TARGET_S) --fail-above $(TEST_CPU_CEILING_S) -- \
	  $(PY) -m pytest -n 3 --dist loadfile --durations=15 --junitxml=$$report $(PYTEST_ARGS) && \
	$(PY) scripts/check_junit.py $$report --expect-at-least $(if $(PYTEST_ARGS),1,$(MIN_TESTS)); rc=$$?; rm -f $$report; exit $$rc

# Boots the default layout's nodes in QEMU guests from the project's own user data (tests/vm).
# Needs root (the guest image is built with mmdebstrap --mode=root; the packages come from apt).
test-vm: vm-root setup .make/vm-system
	$(PY) -m pytest -p no:xdist -m vm tests/vm $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy clusterspec node_render cluster_constructs cluster_ops stacks app.py scripts tests/bench

bench-scale: setup
	$(PY) tests/bench/bench_scale.py $(BENCH_ARGS)

bench-synth: setup
	$(PY) tests/bench/bench_synth.py $(BENCH_ARGS)

# What each kind of change replaces, per role, on the default and the 3+8 fleet (the deploy's own comparison; offline).
bench-rollout: setup
	$(PY) tests/bench/bench_rollout.py

vm-root:
	@[ "$$(id -u)" = 0 ] || { echo "make test-vm: the VM scenarios need root (the guest image is built with mmdebstrap --mode=root); run it as root"; exit 2; }

# vLLM's router vs the toy proxy over the same fake servers on loopback: req/s and added latency at 1, 32, 128 clients.
bench-proxy: setup
	$(PY) -m tests.bench.bench_proxy $(BENCH_ARGS)

# Each router policy over fake servers that serve only vLLM's routes, bounded engines, uneven work: queue waits and spread.
bench-policy: setup
	$(PY) -m tests.bench.bench_policy $(BENCH_ARGS)

# The routers' health checks with servers whose /health waits for their tokenizing event loop: saturated, dead, hung; old and new settings.
bench-health: setup
	$(PY) -m tests.bench.bench_health $(BENCH_ARGS)

# Time to ready: the default layout's nodes booted in VMs with fake servers of known compile and load times.
bench-ready: setup .make/vm-system
	$(PY) -m tests.bench.bench_ready $(BENCH_ARGS)

# Every recipe's layout and the production 3 + 8, as PNG (Graphviz's dot; the same bytes every time:
# tests/clusterspec/test_diagrams.py redraws them and compares).
RECIPES := gptoss-120b-8k1k gptoss-120b-single gptoss-20b-single gptoss-120b-di gptoss-20b-di
diagrams: setup
	@mkdir -p docs/diagrams
	@for r in $(RECIPES); do $(GPTOSS) plan -c recipe=$$r --diagram docs/diagrams/$$r.png > /dev/null || exit 1; echo docs/diagrams/$$r.png; done
	@$(GPTOSS) plan -c config=examples/production-3p8d.yaml --diagram docs/diagrams/production-3p8d.png > /dev/null && echo docs/diagrams/production-3p8d.png

clean:
	rm -rf cdk.out .make .pytest_cache .gptoss
