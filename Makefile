# `make demo` / `make test` work on a fresh machine: they create .venv if missing and install the pinned project.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The suite runs on both cores (pytest-xdist); `make test` deselects what is slow, `make test-slow` runs just that.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, set on this project's
# machines): otherwise each worker and each of the hundreds of commands the tests start compiles the project's modules
# from source again, and the workers rewrite every test module's asserts again (about 15 s of a run on 2 cores).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -n 2 --dist worksteal

.PHONY: demo test test-slow test-all lint clean arm64 gpu-check gpu-venv gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mobile-moe demo

test: $(STAMP)
	$(PYTEST)

test-slow: $(STAMP)
	$(PYTEST) -m 'slow and not gpu'

test-all: $(STAMP)
	$(PYTEST) -m 'not gpu'

# The emulated ARM64 device (mobile_moe/device_bench/arm64.py): Debian's aarch64 cross compiler and qemu-user,
# executorch's aarch64 wheel (downloaded from the package registry, unpacked into the cache), then its tests, which
# build the runner for linux-arm64 and check it against the host runner. Afterwards `mobile-moe bench BUNDLE --device
# arm64-emulated`.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ARM64_PACKAGES := g++-aarch64-linux-gnu qemu-user-static

arm64: $(STAMP)
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq --no-install-recommends $(ARM64_PACKAGES)
	$(BIN)/python -c "from mobile_moe.library.cross import fetch_wheel; print('executorch aarch64 wheel:', fetch_wheel())"
	$(PYTEST) -m slow tests/device_bench/test_arm64_emulated.py

# The whole GPU path in one command and one table (benchmarks/gpu_check.py): gpu tests, an epoch of every model in
# bf16, --compile, DDP over nccl, a reproduce cell, the training-step benchmark; the headline figures (train step, input
# pipeline, gpu tests) in a 420 s budget on one GPU, then the rest until it is spent. GPU=0
# runs the CPU-checkable parts here. OFFLINE=1, for a GPU machine without network whose python3 holds its own torch
# (often not our pin; pyproject says which it supports): a venv that sees that python's packages, plus the wheels of
# `make gpu-wheels` (carried in .whl/), and this project installed without fetching anything.
GPU ?= 1
GPU_CHECK_FLAGS ?=
gpu-check: $(if $(OFFLINE),gpu-venv,$(STAMP))
	$(BIN)/python benchmarks/gpu_check.py $(if $(filter 0,$(GPU)),--cpu) $(GPU_CHECK_FLAGS)

# `venv --system-site-packages` of a python that is itself a venv sees /usr's packages, not that venv's torch: a .pth
# file naming $(PYTHON)'s own site-packages does (appended to sys.path, after the venv's own wheels). Without a pip of
# its own, the venv uses that python's pip and setuptools too, not the older ones a new venv bundles.
gpu-venv:
	[ -x $(BIN)/python ] || $(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/gpu-machine-packages.pth"
	[ ! -d $(WHEELS) ] || $(BIN)/python -m pip install --quiet --no-index --no-deps --ignore-installed $(WHEELS)/*.whl
	$(BIN)/python -m pip install --quiet --no-index --no-deps --no-build-isolation -e .

# Wheels, for GPU_PYTHON on x86-64 Linux, of this project's dependencies that a GPU machine's image lacks (the
# scientific stack, timm and onnx are there; pydantic's family and submitit often are not), at constraints.txt's
# versions, into $(WHEELS) (ignored by git): carry it to the GPU machine, then `make gpu-check OFFLINE=1`.
GPU_PYTHON ?= 3.12
WHEELS ?= .whl
GPU_WHEELS ?= pydantic pydantic-core annotated-types typing-inspection submitit
# nvImageCodec and its nvJPEG (about 29 MB) for benchmarks/gpu_decoders.py alone, into $(WHEELS)/optional: no
# dependency of this project, never installed into the venv (gpu-venv installs $(WHEELS)/*.whl only).
GPU_OPTIONAL_WHEELS ?= nvidia-nvimgcodec-cu13 nvidia-nvjpeg
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-c constraints.txt -d $(WHEELS) $(GPU_WHEELS)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
		-c constraints.txt -d $(WHEELS)/optional $(GPU_OPTIONAL_WHEELS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
