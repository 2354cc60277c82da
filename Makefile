# The documented entry points. `make test` is what CI runs.
PYTHON ?= /usr/bin/python3
PROTOS := protos/dsv41/v1/agent.proto protos/dsv41/v1/control.proto

.PHONY: test test-unit test-integration test-cluster test-sglang protos check-protos deps

# What the tests (and the demo) need, installed once; quick when it is all there.
deps:
	tools/install-test-deps.sh

# Every tier; select with e.g. `make test TIERS=unit` or `make test TIERS="unit or sglang"`.
TIERS ?= unit or integration or cluster or sglang or realengine
test: deps
	$(PYTHON) -m pytest -m "$(TIERS)" tests

test-unit: deps
	$(PYTHON) -m pytest -m unit tests

# Regenerates the committed gRPC stubs with Debian's protoc 3.21 and grpc plugin 1.51, which the
# distribution's python3-protobuf / python3-grpcio load (a newer protoc's stubs refuse to).
protos:
	tools/gen-protos.sh dsv41

check-protos:
	tools/gen-protos.sh --check

# docs/configuration.md, the reference of every cluster.env key, from coordinator/schema.py (a unit
# test fails when the committed file is stale; `check-config-reference` says how, with a diff).
.PHONY: config-reference check-config-reference
config-reference:
	$(PYTHON) tools/config-reference.py

check-config-reference:
	$(PYTHON) tools/config-reference.py --check

# Debian packages (packaging/README.md): built from the last commit (DEBS_SOURCE=worktree: from
# the working tree as it is) into packaging/out/, reproducibly; `make debs VERSION_SUFFIX=+1` builds
# a higher version for upgrades; `make debs-lintian` checks them (exit 1 on any lintian error).
.PHONY: debs debs-lintian debs-lintian-trixie
VERSION_SUFFIX ?=
DEBS_OUT ?= packaging/out
DEBS_SOURCE ?= HEAD
debs:
	$(PYTHON) packaging/debs.py build --out $(DEBS_OUT) --version-suffix "$(VERSION_SUFFIX)" --source $(DEBS_SOURCE)

debs-lintian:
	$(PYTHON) packaging/debs.py lintian --out $(DEBS_OUT)

# Debian 13's lintian on the same files, in a cached trixie tree (root; tools/lintian-trixie.sh).
debs-lintian-trixie:
	tools/lintian-trixie.sh $(DEBS_OUT)

# The local demo: three systemd nodes with the packages (root). ENGINE=sglang (the default): real
# SGLang ranks on the CPU as docs/cpu-rehearsal.md sets them up; ENGINE=sim: the stand-in engine.
# GROUPS=2: six nodes as two TP groups of three behind the gateway on spark1 (the stand-in engine,
# the default then; ENGINE=sglang is refused: two real groups do not fit two cores).
.PHONY: demo demo-down
GROUPS ?= 1
ENGINE ?= $(if $(filter 1,$(GROUPS)),sglang,sim)
demo:
	$(if $(and $(filter sglang,$(ENGINE)),$(filter-out 1,$(GROUPS))),$(error GROUPS=$(GROUPS) runs the \
	stand-in engine only: two groups of real SGLang CPU ranks do not fit this machine's two cores; use \
	`make demo GROUPS=$(GROUPS)` (ENGINE=sim) or one group with ENGINE=sglang))
	tools/install-test-deps.sh $(if $(filter sim,$(ENGINE)),--demo)
	$(PYTHON) tools/demo.py up --engine $(ENGINE) --groups $(GROUPS)

demo-down:
	$(PYTHON) tools/demo.py down
