#!/usr/bin/env bash
# Builds the `runtime` binary and the static guest agent (release).
# The agent runs as /init of an initramfs with no libraries, so it is linked
# statically; `--target` keeps that flag away from build scripts and macros.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[build] runtime (release)" >&2
cargo build --release --locked -p runtime-cli
echo "[build] guest agent (release, static)" >&2
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked -p runtime-agent --target x86_64-unknown-linux-gnu
