#!/usr/bin/env bash
# Installs the host packages `runtime` needs: QEMU 10 (bookworm-backports), the
# tools that build the guest (kernel source and its build deps, debootstrap,
# e2fsprogs, npm and python3-venv: the image build fetches Node.js, Bun and uv
# with them), the Python used by the end-to-end suite and the headless Chromium
# its login test drives, and the interpreters (node with TypeScript, R, a JDK,
# Go) that the interpreter drivers' tests start on this host, as the default
# image has them, the container registry of the image-pull tests, and PostgreSQL for the store's
# tests on it. Idempotent; needs root.
# The backports source is derived from the machine's own Debian source so that
# no mirror host is written down here.
set -euo pipefail

log() { printf '[host-packages] %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  log "not root: skipping package installation (install them as root: $0)"
  exit 0
fi

src_dir=/etc/apt/sources.list.d
bpo="$src_dir/runtime-backports.sources"
if [ ! -f "$bpo" ]; then
  base=""
  if [ -f "$src_dir/debian.sources" ]; then
    base=$(awk '/^URIs:/ && !/security/ {print $2; exit}' "$src_dir/debian.sources")
  fi
  if [ -z "$base" ] && [ -f /etc/apt/sources.list ]; then
    base=$(awk '/^deb / && !/security/ {print $2; exit}' /etc/apt/sources.list)
  fi
  [ -n "$base" ] || { log "cannot find the Debian mirror in the apt sources"; exit 1; }
  codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
  log "adding ${codename}-backports from the machine's Debian source"
  cat >"$bpo" <<SRC
Types: deb
URIs: $base
Suites: ${codename}-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi

export DEBIAN_FRONTEND=noninteractive
log "apt-get update"
apt-get update -qq
codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
log "installing QEMU from ${codename}-backports"
apt-get install -y -qq --no-install-recommends -t "${codename}-backports" qemu-system-x86 >/dev/null
log "installing guest build tools"
# (debian-archive-keyring: the current one has the keys of the guest's
# newer suite, trixie, which debootstrap checks)
apt-get install -y -qq --no-install-recommends \
  debootstrap debian-archive-keyring e2fsprogs xz-utils bc bison flex libelf-dev libssl-dev cpio rsync kmod \
  python3-venv sqlite3 >/dev/null
# busybox-static: the shell supplied to registry images that have none
# (docs/images.md, "Images without a shell").
apt-get install -y -qq --no-install-recommends busybox-static >/dev/null
# PostgreSQL: the store's tests and tests/e2e/test_postgres.py start
# throwaway clusters of their own with its initdb and pg_ctl (the package's
# own cluster is not used).
log "installing postgresql"
apt-get install -y -qq --no-install-recommends postgresql >/dev/null
# npm fetches the guest's Node.js, npm, Corepack, Bun and TypeScript (npm
# pack); a machine that has npm already (another Node.js) keeps its own.
if ! command -v npm >/dev/null; then
  log "installing npm"
  apt-get install -y -qq --no-install-recommends npm >/dev/null
fi
log "installing chromium (the end-to-end suite drives the login page and the web console in it, headless)"
apt-get install -y -qq --no-install-recommends chromium >/dev/null
log "installing the interpreters the drivers' tests run on this host (guest/interp/tests)"
apt-get install -y -qq --no-install-recommends \
  nodejs node-typescript r-base-core default-jdk-headless golang-go >/dev/null
log "installing the end-to-end suite's container registry and its test image's parts (tests/e2e/registry.py)"
# docker-registry: the reference registry ("distribution"); apache2-utils:
# htpasswd -B for its bcrypt logins; busybox-static and bash-static: the
# test image's root file system, built with no network.
apt-get install -y -qq --no-install-recommends \
  docker-registry apache2-utils busybox-static bash-static >/dev/null
# The package's own registry service is not wanted: tests start their own.
if command -v systemctl >/dev/null && systemctl is-enabled docker-registry >/dev/null 2>&1; then
  systemctl disable --now docker-registry >/dev/null 2>&1 || true
fi
# Registry images: layers are decompressed with gzip and zstd on the host.
log "installing zstd (registry image layers)"
apt-get install -y -qq --no-install-recommends zstd >/dev/null
log "done: $(qemu-system-x86_64 --version | head -1)"
