# Two commands do everything on a fresh machine: `make synth` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
CDK := node_modules/.bin/cdk
# Quiet, offline CLI: no telemetry, no notices, no Node end-of-life banner.
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := $(shell node -p 'process.versions.node.split(".")[0]' 2>/dev/null)
export AWS_SDK_JS_NODE_VERSION_SUPPORT_WARNING_DISABLED := true
export CDK_DISABLE_CLI_TELEMETRY := true
# The CLI ignores CDK_DEFAULT_REGION without credentials; AWS_REGION is what it reads.
export AWS_REGION ?= us-east-2
# cdk.json runs `python3 app.py`: the project venv must come first on PATH.
export PATH := $(CURDIR)/.venv/bin:$(PATH)
CDK_ARGS ?=

.PHONY: setup synth plan test lint clean

setup: .make/python .make/node .make/system

.make/python: pyproject.toml
	@mkdir -p .make
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

.make/node: package.json package-lock.json
	@mkdir -p .make
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# systemd-analyze checks the rendered units; curl runs the wait helper in tests.
.make/system:
	@mkdir -p .make
	@command -v systemd-analyze >/dev/null && command -v curl >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd curl >/dev/null; }
	@touch $@

synth: setup
	rm -rf cdk.out
	$(CDK) synth --no-notices --quiet $(CDK_ARGS)
	@echo "templates:" && ls -1 $(CURDIR)/cdk.out/*.template.json
	$(PY) scripts/cluster.py plan $(CDK_ARGS)

plan: setup
	$(PY) scripts/cluster.py plan $(CDK_ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf cdk.out .make .pytest_cache
