# bulkhead: the commands a newcomer runs. See README.md.
SHELL := /bin/bash
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never
# Long-lived builds and tools live outside the checkout (see scripts/setup.sh).
export BULKHEAD_CACHE ?= /var/cache/bulkhead
export PATH := $(BULKHEAD_CACHE)/venv/bin:$(PATH)

.PHONY: all setup build test test-node under-load demo bench bench-node lint fmt fuzz fuzz-smoke initramfs kernel image clean help

all: build

help:
	@echo "make setup  - install what the project needs (idempotent)"
	@echo "make build  - build every crate"
	@echo "make test   - setup, lints, then the whole test suite (with the emulated node's stage)"
	@echo "make test-node - every bulkhead-vmm test in the emulated AMD-V node (tests/node), the 2.1 twins too"
	@echo "make under-load - the integration and KVM tests three times while a CPU hog spins on one core"
	@echo "make demo   - run a Pod through containerd's CRI with bulkhead and print what happened"
	@echo "make bench  - micro-benchmarks, the CRI pod-start benchmark against runc, warm vs cold VM pod starts"
	@echo "make bench-node - warm vs cold pods with the real guest on bulkhead-vmm, in the emulated AMD-V node"
	@echo "make lint   - cargo fmt --check and clippy -D warnings"
	@echo "make fuzz-smoke - every fuzz target for 30 s (make fuzz: FUZZ_TIME s each, default 60)"
	@echo "make image  - the node installer image as an OCI archive (no container engine needed)"

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

# The node installer image (node-installer/mkimage.py; the same layout as node-installer/Containerfile), built
# without a container engine: static release binaries (musl; the VMM static glibc), the cached guest kernel, the initramfs, virtiofsd from
# `make setup` and busybox-static (nsenter). Reproducible: file times are the last commit's. Push it with skopeo or
# ctr (README, "Installing on a cluster").
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
IMAGE_REF ?= ghcr.io/bulkhead-dev/bulkhead-node-installer:$(VERSION)
IMAGE ?= $(CURDIR)/target/image/bulkhead-node-installer.oci.tar
MUSL := x86_64-unknown-linux-musl
GNU := x86_64-unknown-linux-gnu
RELEASE_BIN = $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)/$(MUSL)/release
VMM_BIN = $(or $(CARGO_TARGET_DIR),$(CURDIR)/target)/$(GNU)/release/bulkhead-vmm
image: setup initramfs
	$(CARGO) build --release --locked --target $(MUSL) -p bulkhead-node-installer -p bulkhead-shim
	@# The VMM does not build for musl yet (the libc crate's musl pthread_t and ioctl types): glibc, linked statically.
	CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
		$(CARGO) build --release --locked --target $(GNU) -p bulkhead-vmm
	@file -L $(VMM_BIN) | grep -Eq 'statically linked|static-pie linked' || { file -L $(VMM_BIN); exit 1; }
	SOURCE_DATE_EPOCH=$$(git log -1 --format=%ct 2>/dev/null || echo 0) python3 node-installer/mkimage.py \
		--out $(IMAGE) --ref $(IMAGE_REF) --busybox /bin/busybox \
		--installer $(RELEASE_BIN)/bulkhead-node-installer \
		--artifact containerd-shim-bulkhead-v2=$(RELEASE_BIN)/containerd-shim-bulkhead-v2 \
		--artifact bulkhead-ctl=$(RELEASE_BIN)/bulkhead-ctl \
		--artifact bulkhead-vmm=$(VMM_BIN) \
		--artifact bulkhead-agent=guest-kernel/build/bulkhead-agent \
		--artifact virtiofsd=$(BULKHEAD_CACHE)/bin/virtiofsd \
		--artifact vmlinux=$$(guest-kernel/build-kernel.sh) \
		--artifact initramfs.cpio.gz=guest-kernel/build/initramfs.cpio.gz

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Binaries first: end-to-end tests start the freshly built shim, agent and VMM.
test: setup lint build kernel
	@scripts/run-tests.sh

# The emulated node's stage alone, with the tests `make test` leaves out for CI's time (scripts/node-stage.sh).
test-node: setup build kernel
	@scripts/node-stage.sh --all

# The CRI warm-start benchmark with the real guest on bulkhead-vmm, in the emulated AMD-V node
# (warm against cold to the first ExecSync; diagnostic figures, scripts/node-bench.sh).
bench-node: setup kernel
	@scripts/node-bench.sh

# Stability: the integration and KVM test binaries three times in a row beside a one-core CPU hog.
under-load: setup build kernel
	@scripts/under-load.sh

demo: setup build
	$(CARGO) run -q -p bulkhead-integration --bin bulkhead-demo

# Release shim/agent/VMM, so the comparison with runc (a release Go binary) is fair.
bench: setup
	$(CARGO) build --release -p bulkhead-shim -p bulkhead-agent -p bulkhead-vmm
	$(CARGO) bench -p bulkhead-benches

fmt:
	$(CARGO) fmt --all
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml

# Fuzz every cargo-fuzz target in fuzz/ for FUZZ_TIME s each (libFuzzer + ASan, own target dir;
# RUSTC_BOOTSTRAP lets stable rustc take the -Z flags). A crash stops the run; input in fuzz/artifacts/.
FUZZ_TIME ?= 60
fuzz:
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	cd fuzz && for t in $$($(CARGO) fuzz list); do \
		echo "== fuzz $$t ($(FUZZ_TIME) s)"; \
		CARGO_TARGET_DIR=$(CURDIR)/fuzz/target RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run $$t -- \
			-max_total_time=$(FUZZ_TIME) -timeout=10 -rss_limit_mb=2048 2>&1 \
			| grep -E '^(Done|==[0-9]+==|SUMMARY|thread|Failing input|Reproduce with)|artifacts/'; \
		test $${PIPESTATUS[0]} -eq 0 || exit 1; \
	done

# A quick pass over every fuzz target (not part of `make test`).
fuzz-smoke:
	@$(MAKE) --no-print-directory fuzz FUZZ_TIME=30

clean:
	$(CARGO) clean
