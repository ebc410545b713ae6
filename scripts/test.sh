#!/usr/bin/env bash
# The whole test suite from a fresh machine: host packages (as root), the
# binary and the static guest agent, the guest kernel and image (built once
# into the cache dir, ~10 min the first time, with progress), the Rust tests,
# the interpreter drivers on this host (guest/interp/tests) and the deploy/
# files against the binary (tests/deploy), then the Python end-to-end suite
# through the official client against a real `runtime serve` (tests/e2e).
# Extra arguments go to the end-to-end pytest (e.g. -k exec -x).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n[test] %s (%s)\n' "$*" "$(date -u +%H:%M:%S)" >&2; }

step "host packages"
bash scripts/host-packages.sh

step "build"
bash scripts/build.sh

step "guest kernel and image"
target/release/runtime image build

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release --locked -- -D warnings

step "Rust tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --release --locked --no-tests=warn
else
  cargo test --workspace --release --locked
fi

step "Python environment (.venv)"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt

step "interpreter drivers, deploy/ files"
.venv/bin/python -m pytest guest/interp/tests tests/deploy -q

step "end-to-end suite"
.venv/bin/python -m pytest tests/e2e "$@"
step "all passed"
