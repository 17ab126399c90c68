# Thin wrapper over CMake: `make` builds into build/ (Release; with the torch backend when torch
# is found), `make test` runs every test through ctest, `make python-install` installs the Python
# package, `make demo` installs what the trainer needs (when missing) and trains Fashion-MNIST on
# 2 ranks; `make demo-gpt` does the same for the GPT trainer on the fortunes quotations.
BUILD ?= build
CMAKE_FLAGS ?=
# Parallel jobs of the build and of ctest: JOBS=N, else the -jN given to make (`make -j1 test`),
# else one per CPU. (Evaluated in the recipes, where make has put -jN into MAKEFLAGS.)
NPROC := $(shell nproc 2>/dev/null || echo 2)
J = $(or $(JOBS),$(patsubst -j%,%,$(filter -j%,$(MAKEFLAGS))),$(NPROC))

.PHONY: all build test test-extra test-setup torch-suite demo demo-gpt gpt-demo install uninstall python-install clean asan tsan fuzz

all: build

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(J)

# test: installs what the tests need when it is missing (tools/test_setup.sh: Debian packages as
# root, torch==2.13.0 numpy pytest from PyPI for the python3 on PATH; DDP_SETUP=0 skips it), then
# builds and runs every test through ctest. The setup runs before CMake looks for torch.
test: test-setup
	$(MAKE) build
	$(call ctest_in,$(BUILD)) -LE extra $(CTEST_FLAGS)

# test-extra: the tests too slow for make test (label "extra": packaging for the other torch, the
# full FSDP2 matrix, Lightning and DeepSpeed, bench/zero3_vs_fsdp2.sh end to end).
test-extra: build
	$(call ctest_in,$(BUILD)) -L extra $(CTEST_FLAGS)

# ctest in build directory $(1): J tests that compute at a time, each holding one of J "cores"
# slots (RESOURCE_GROUPS, tests/CMakeLists.txt), and up to J more of those labelled "waits",
# which hold none (they sleep through timeouts on purpose).
ctest_in = printf '{"version":{"major":1,"minor":0},"local":[{"cores":[{"id":"0","slots":%d}]}]}\n' \
	$(J) >$(1)/ctest-cores.json && cd $(1) && ctest --output-on-failure -j $$(( 2 * $(J) )) \
	--resource-spec-file ctest-cores.json

test-setup:
	./tools/test_setup.sh

# torch-suite: PyTorch's own distributed test suite against backend "ddp" and, as the baseline,
# gloo, for every torch the backend is built for, at world sizes 2 and 3 (tests/torch_suite/;
# results and time in docs/pytorch.md). Logs in $(BUILD)/torch-suite/.
torch-suite: test-setup
	$(MAKE) build
	cmake --build $(BUILD) --target torch-suite

demo:
	./tools/demo.sh

# demo-gpt (also gpt-demo): the byte-level GPT on the fortunes quotations, 2 ranks, about 2
# minutes.
demo-gpt:
	./tools/demo_gpt.sh

gpt-demo: demo-gpt

# install: the libraries and the installed programs only (target ddp_install_parts), not the
# tests; PREFIX=/opt/ddp installs there (the programs find libddp.so through $$ORIGIN/../lib).
install: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(J) --target ddp_install_parts
	cmake --install $(BUILD) $(if $(PREFIX),--prefix $(PREFIX),)

# uninstall: removes what the last `make install` from $(BUILD) wrote.
uninstall:
	cmake --build $(BUILD) --target uninstall

# The Python package (NumPy API + torch backend) into the current Python environment. On
# Debian's system Python add PIP_FLAGS=--break-system-packages, or run it inside a venv made
# with --system-site-packages (so it sees python3-torch).
PYTHON ?= python3
python-install: build
	LIBDDP_BUILD_DIR=$(abspath $(BUILD)) $(PYTHON) -m pip install --no-build-isolation ./python $(PIP_FLAGS)

asan:
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DDDP_SANITIZE=ON
	cmake --build build-asan -j $(J)
	$(call ctest_in,build-asan)

tsan:
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DDDP_TSAN=ON
	cmake --build build-tsan -j $(J)
	$(call ctest_in,build-tsan)

# fuzz: every libFuzzer target (tests/fuzz/, docs/fuzzing.md) built with clang in build-fuzz/
# (everything instrumented: coverage, ASan, UBSan) and run for FUZZ_SECONDS each (default 60),
# one after the other; FUZZ_TARGETS="store_server env" runs only those. Fails when a target
# finds anything. CI: make fuzz FUZZ_SECONDS=5. The longer run: bench/fuzz_long.sh.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?=
fuzz:
	@echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }' | \
	  clang -x c -fsanitize=fuzzer,address,undefined -o /dev/null - 2>/dev/null || { \
	  echo "make fuzz: clang cannot link libFuzzer: apt-get install clang libclang-rt-14-dev" >&2; exit 2; }
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang \
	  -DCMAKE_CXX_COMPILER=clang++ -DDDP_FUZZ=ON -DDDP_TORCH=OFF -DDDP_WITH_MPI=OFF
	cmake --build $(FUZZ_BUILD) -j $(J) --target ddp_fuzzers
	sh tests/fuzz/run.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

clean:
	rm -rf $(BUILD) build-asan build-tsan build-fuzz
