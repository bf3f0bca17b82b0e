# bulkhead: the commands a newcomer runs. See README.md.
SHELL := /bin/bash
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never
# Long-lived builds and tools live outside the checkout (see scripts/setup.sh).
export BULKHEAD_CACHE ?= /var/cache/bulkhead
export PATH := $(BULKHEAD_CACHE)/venv/bin:$(PATH)

.PHONY: all setup build test demo bench lint fmt initramfs kernel clean help

all: build

help:
	@echo "make setup  - install what the project needs (idempotent)"
	@echo "make build  - build every crate"
	@echo "make test   - setup, lints, then the whole test suite"
	@echo "make demo   - run a Pod through containerd's CRI with bulkhead and print what happened"
	@echo "make bench  - micro-benchmarks and the CRI pod-start benchmark against runc"
	@echo "make lint   - cargo fmt --check and clippy -D warnings"

setup:
	@scripts/setup.sh

build:
	$(CARGO) build --workspace --bins

# The guest vmlinux from Debian's linux-source-6.12, cached in $(BULKHEAD_CACHE) by content hash.
kernel:
	@guest-kernel/build-kernel.sh >/dev/null

# The static musl agent and its initramfs (guest-kernel/Makefile).
initramfs:
	$(MAKE) -C guest-kernel initramfs

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Binaries first: end-to-end tests start the freshly built shim, agent and VMM.
test: setup lint build kernel
	@scripts/run-tests.sh

demo: setup build
	$(CARGO) run -q -p bulkhead-integration --bin bulkhead-demo

# Release shim/agent/VMM, so the comparison with runc (a release Go binary) is fair.
bench: setup
	$(CARGO) build --release -p bulkhead-shim -p bulkhead-agent -p bulkhead-vmm
	$(CARGO) bench -p bulkhead-benches

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
