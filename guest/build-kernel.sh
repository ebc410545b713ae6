#!/usr/bin/env bash
# Builds the sandbox guest kernel: Debian's linux-source-6.12, tinyconfig plus
# guest/kernel.fragment, all built in, as an uncompressed PVH ELF (vmlinux)
# that QEMU `-M microvm` boots directly with `-kernel vmlinux`.
#
# Usage: guest/build-kernel.sh OUT_DIR
# Output: OUT_DIR/vmlinux and OUT_DIR/config (the final .config).
#
# Needs root only to install linux-source-6.12 when it is missing. Idempotent:
# builds in a temporary directory and replaces OUT_DIR as a whole, atomically
# (via OUT_DIR.partial). About 5 minutes on 2 cores.
set -euo pipefail

log() { printf '[kernel] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FRAGMENT="$HERE/kernel.fragment"
[ -f "$FRAGMENT" ] || die "missing $FRAGMENT"
OUT_DIR=$1
SRC_PKG=linux-source-6.12
TARBALL=/usr/src/linux-source-6.12.tar.xz
JOBS=${JOBS:-$(nproc)}
START=$(date +%s)
elapsed() { local s=$(( $(date +%s) - START )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }

# --- kernel source ------------------------------------------------------------------
if [ ! -f "$TARBALL" ]; then
  [ "$(id -u)" -eq 0 ] || die "$TARBALL is missing and installing $SRC_PKG needs root"
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
  export DEBIAN_FRONTEND=noninteractive
  target=()
  if apt-cache policy 2>/dev/null | grep -q "${codename}-backports"; then
    target=(-t "${codename}-backports")
  fi
  log "installing $SRC_PKG ${target[*]:-} (about 150 MB)"
  apt-get install -y -qq --no-install-recommends "${target[@]}" "$SRC_PKG" >/dev/null \
    || die "apt-get install $SRC_PKG failed (run scripts/host-packages.sh first?)"
  [ -f "$TARBALL" ] || die "$SRC_PKG installed but $TARBALL is missing"
fi
for tool in make gcc bison flex bc perl; do
  command -v "$tool" >/dev/null || die "missing build tool: $tool (run scripts/host-packages.sh)"
done
[ -f /usr/include/libelf.h ] || die "missing libelf-dev (run scripts/host-packages.sh)"
[ -f /usr/include/openssl/ssl.h ] || die "missing libssl-dev (run scripts/host-packages.sh)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/guest-kernel.XXXXXX")
mkdir -p "$(dirname "$OUT_DIR")"
OUT_ABS=$(cd "$(dirname "$OUT_DIR")" && pwd)/$(basename "$OUT_DIR")
PARTIAL="$OUT_ABS.partial"
cleanup() {
  local rc=$?
  rm -rf "$WORK" "$PARTIAL"
  [ $rc -eq 0 ] || log "failed (exit $rc) after $(elapsed)"
}
trap cleanup EXIT

log "extracting $(basename "$TARBALL")"
tar -xJf "$TARBALL" -C "$WORK"
SRC=$(find "$WORK" -mindepth 1 -maxdepth 1 -type d -name 'linux-source-*' | head -n1)
[ -n "$SRC" ] && [ -f "$SRC/Makefile" ] || die "unexpected tarball layout"
log "source: $(make -s -C "$SRC" kernelversion 2>/dev/null) ($(elapsed))"

# --- configure ------------------------------------------------------------------
log "configuring: tinyconfig + $(basename "$FRAGMENT")"
CFGLOG="$WORK/config.log"
(
  cd "$SRC"
  make tinyconfig
  scripts/kconfig/merge_config.sh -m .config "$FRAGMENT"
  make olddefconfig
) >"$CFGLOG" 2>&1 || { tail -n 60 "$CFGLOG" >&2; die "configuration failed"; }

# every symbol the fragment asks for must have survived olddefconfig
missing=$(awk '
  FNR == NR {
    if (match($0, /^CONFIG_[A-Za-z0-9_]+=/)) { k = substr($0, 1, RLENGTH - 1); have[k] = substr($0, RLENGTH + 1) }
    else if (match($0, /^# CONFIG_[A-Za-z0-9_]+ is not set/)) { split($0, a, " "); have[a[2]] = "n" }
    next
  }
  /^CONFIG_[A-Za-z0-9_]+=/ {
    i = index($0, "="); k = substr($0, 1, i - 1); v = substr($0, i + 1)
    got = (k in have) ? have[k] : "n"
    if (got != v) printf "  %s: wanted %s, got %s\n", k, v, (k in have) ? got : "(absent)"
  }' "$SRC/.config" "$FRAGMENT")
if [ -n "$missing" ]; then
  log "the merged .config does not have these fragment options:"
  printf '%s\n' "$missing" >&2
  die "fix kernel.fragment (a dependency is missing)"
fi
log "config ok: $(grep -c '=y$' "$SRC/.config") options built in ($(elapsed))"

# --- build ------------------------------------------------------------------------
BUILDLOG="$WORK/build.log"
log "make -j$JOBS vmlinux (about 5 min on 2 cores); progress every 20 s"
make -C "$SRC" -j"$JOBS" vmlinux >"$BUILDLOG" 2>&1 &
MAKE_PID=$!
# if we are interrupted, stop the build we started
trap 'kill "$MAKE_PID" 2>/dev/null || true' INT TERM
while kill -0 "$MAKE_PID" 2>/dev/null; do
  for _ in $(seq 20); do
    kill -0 "$MAKE_PID" 2>/dev/null || break
    sleep 1
  done
  kill -0 "$MAKE_PID" 2>/dev/null || break
  n=$(grep -c '^ *CC ' "$BUILDLOG" 2>/dev/null || true)
  log "compiling: ${n:-0} objects so far ($(elapsed))"
done
if ! wait "$MAKE_PID"; then
  log "build failed; last 60 lines of the build log:"
  tail -n 60 "$BUILDLOG" >&2
  exit 1
fi
trap - INT TERM
n=$(grep -c '^ *CC ' "$BUILDLOG" || true)
[ -f "$SRC/vmlinux" ] || die "make succeeded but vmlinux is missing"
log "built vmlinux: $n objects compiled ($(elapsed))"

# --- output -------------------------------------------------------------------------
rm -rf "$PARTIAL"
mkdir -p "$PARTIAL"
cp "$SRC/vmlinux" "$PARTIAL/vmlinux"
cp "$SRC/.config" "$PARTIAL/config"
if [ -d "$OUT_ABS" ]; then
  # swap in the new directory; the old one is removed afterwards
  mv "$OUT_ABS" "$OUT_ABS.old.$$"
  mv "$PARTIAL" "$OUT_ABS"
  rm -rf "$OUT_ABS.old.$$"
else
  mv "$PARTIAL" "$OUT_ABS"
fi
log "done ($(elapsed)): $OUT_ABS/vmlinux ($(( $(stat -c %s "$OUT_ABS/vmlinux") / 1048576 )) MiB)"
