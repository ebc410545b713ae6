#!/usr/bin/env bash
# The one-command start: host packages (as root), the binary and agent, then
# `runtime serve`, which builds the guest kernel and image on first use
# (progress is shown) and serves with an embedded SQLite store.
# Arguments go to `runtime serve` (e.g. --listen 127.0.0.1:8080 --data-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/host-packages.sh
bash scripts/build.sh
exec target/release/runtime serve "$@"
