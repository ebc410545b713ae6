#!/usr/bin/env bash
# Builds the sandbox guest root filesystem: a Debian bookworm minbase tree with
# the sandbox toolchain (python3 + numpy/pandas/matplotlib, node + TypeScript,
# R, a JDK with jshell, Go, gcc, git, ...) packed into a sparse ext4 image.
# The interpreter (crates/server/src/interpreter.rs) runs its seven languages
# with these packages and nothing downloaded later.
#
# Usage: guest/build-rootfs.sh OUT_DIR
# Output: OUT_DIR/rootfs.ext4 (3072 MiB apparent size, sparse: the smallest
# disk a sandbox may ask for; the agent grows the file system to the
# sandbox's disk at boot).
#
# Needs root (debootstrap, chroot). Idempotent: every run starts from scratch
# in a temporary directory and replaces OUT_DIR/rootfs.ext4 atomically.
# The Debian mirror is taken from the machine's own apt sources.
set -euo pipefail

log() { printf '[rootfs] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap needs it)"

OUT_DIR=$1
SUITE=${ROOTFS_SUITE:-bookworm}
IMAGE_SIZE=${ROOTFS_IMAGE_SIZE:-3072M}
PACKAGES=(
  bash coreutils python3 python3-pip python3-venv python3-numpy python3-pandas
  python3-matplotlib nodejs npm git gcc g++ make libc6-dev curl ca-certificates
  findutils sudo procps e2fsprogs tar gzip xz-utils unzip less file iproute2
  node-typescript r-base-core default-jdk-headless golang-go
)

for tool in debootstrap mkfs.ext4 chroot; do
  command -v "$tool" >/dev/null || die "missing tool: $tool (run scripts/host-packages.sh)"
done

# --- mirror --------------------------------------------------------------------
# The first non-security URI of an apt source that carries $SUITE itself
# (deb822 *.sources stanzas first, then one-line sources.list entries).
find_mirror() {
  local m="" f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    m=$(awk -v suite="$SUITE" 'BEGIN { RS = "" }
      {
        uri = ""; ok = 0
        n = split($0, l, "\n")
        for (i = 1; i <= n; i++) {
          if (l[i] ~ /^URIs:/) { split(l[i], w, /[ \t]+/); uri = w[2] }
          if (l[i] ~ /^Suites:/) { k = split(l[i], w, /[ \t]+/); for (j = 2; j <= k; j++) if (w[j] == suite) ok = 1 }
          if (l[i] ~ /^Enabled:[ \t]*no/) ok = 0
        }
        if (ok && uri != "" && uri !~ /security/) { print uri; exit }
      }' "$f")
    [ -n "$m" ] && break
  done
  if [ -z "$m" ]; then
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
      [ -f "$f" ] || continue
      m=$(awk -v suite="$SUITE" '$1 == "deb" && !/security/ {
          for (i = 2; i < NF; i++) if ($i ~ /:\/\// && $(i + 1) == suite) { print $i; exit }
        }' "$f")
      [ -n "$m" ] && break
    done
  fi
  printf '%s' "$m"
}
MIRROR=${ROOTFS_MIRROR:-$(find_mirror)}
[ -n "$MIRROR" ] || die "cannot find a Debian mirror in the apt sources (set ROOTFS_MIRROR)"
log "suite $SUITE, mirror $MIRROR"

# --- work dir ------------------------------------------------------------------
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/guest-rootfs.XXXXXX")
ROOT="$WORK/root"
cleanup() {
  local rc=$?
  # never leave pseudo filesystems mounted inside the tree before deleting it
  for m in proc sys dev/pts dev; do
    mountpoint -q "$ROOT/$m" 2>/dev/null && umount -l "$ROOT/$m" || true
  done
  # --one-file-system: never follow a mount that failed to go away
  rm -rf --one-file-system "$WORK"
  rm -f "$OUT_DIR/rootfs.ext4.partial"
  [ $rc -eq 0 ] || log "failed (exit $rc)"
}
trap cleanup EXIT
START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START ))s"; }

# --- package list: drop names the archive does not know -------------------------
# (apt-cache knows the host's suites; host and guest are both bookworm here.)
KNOWN=$(apt-cache pkgnames 2>/dev/null || true)
INCLUDE=()
for p in "${PACKAGES[@]}"; do
  if [ -z "$KNOWN" ] || grep -qxF "$p" <<<"$KNOWN"; then
    INCLUDE+=("$p")
  else
    log "warning: package '$p' not found in the host's apt index, dropping it"
  fi
done

# progress filter: keeps the full output in a log file, shows a few lines.
# usage: some-command 2>&1 | progress LABEL LOGFILE RCFILE
# (the command's exit status must be echoed as a final "__rc=N" line)
progress() {
  local label=$1 logf=$2 rcf=$3 line s stage="" last=0 n=0 now
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$logf"
    case "$line" in
      __rc=*) echo "${line#__rc=}" >"$rcf" ;;
      "I: Retrieving "*|"I: Extracting "*|"I: Installing "*|"I: Unpacking "*|"I: Configuring "*|"I: Base system"*|"Get:"*|"Unpacking "*|"Setting up "*)
        # a line when a new stage starts (at most one every 3 s, as dpkg
        # alternates Unpacking/Setting up), else at most one every 10 s
        s=${line#I: }; s=${s%% *}; s=${s%%:*}
        n=$((n + 1))
        now=$(date +%s)
        if { [ "$s" != "$stage" ] && [ $((now - last)) -ge 3 ]; } || [ $((now - last)) -ge 10 ]; then
          stage=$s; last=$now
          printf '[rootfs] %s (%s, %s steps): %s\n' "$label" "$(elapsed)" "$n" "${line#I: }" >&2
        fi
        ;;
      E:*|W:*|"dpkg: error"*|*"Errors were encountered"*) printf '[rootfs] %s: %s\n' "$label" "$line" >&2 ;;
    esac
  done
}
check_rc() {
  local label=$1 logf=$2 rcf=$3 rc
  rc=$(cat "$rcf" 2>/dev/null || echo 1)
  if [ "$rc" != 0 ]; then
    log "$label failed (exit $rc); last lines of its log:"
    tail -n 40 "$logf" >&2
    [ -f "$ROOT/debootstrap/debootstrap.log" ] && tail -n 40 "$ROOT/debootstrap/debootstrap.log" >&2
    exit 1
  fi
}

# --- stage 1: debootstrap minbase -------------------------------------------------
# debootstrap's own resolver is too simple for the big package set (with
# --include=npm,... its configure step fails), so it only lays down minbase and
# apt-get installs the rest inside the tree.
log "debootstrap --variant=minbase $SUITE"
mkdir -p "$ROOT"
{ debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$ROOT" "$MIRROR" 2>&1; echo "__rc=$?"; } \
  | progress debootstrap "$WORK/debootstrap.log" "$WORK/debootstrap.rc"
check_rc debootstrap "$WORK/debootstrap.log" "$WORK/debootstrap.rc"
log "debootstrap done ($(elapsed)), tree is $(du -smx "$ROOT" | cut -f1) MiB"

# --- stage 2: apt-get install the sandbox toolchain -------------------------------
# apt sources inside the guest: the same mirror, plus updates and security when
# the host has them (so that the image gets the current security fixes).
SECURITY=""
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  SECURITY=$(awk '/^URIs:/ && /security/ {print $2; exit}' "$f")
  [ -n "$SECURITY" ] && break
done
if [ -z "$SECURITY" ] && [ -f /etc/apt/sources.list ]; then
  SECURITY=$(awk '/^deb / && /security/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' /etc/apt/sources.list)
fi
{
  echo "deb $MIRROR $SUITE main"
  echo "deb $MIRROR $SUITE-updates main"
  [ -n "$SECURITY" ] && echo "deb $SECURITY $SUITE-security main"
} >"$ROOT/etc/apt/sources.list"
# no daemons may start inside the chroot
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
mount -t proc proc "$ROOT/proc"
mount -t sysfs sys "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$ROOT/dev/pts"
in_root() {
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive "$@"
}
APT_OPTS=(-o Dpkg::Use-Pty=0 -o APT::Install-Recommends=0 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
log "apt-get update"
{ in_root apt-get "${APT_OPTS[@]}" update 2>&1; echo "__rc=$?"; } | progress apt "$WORK/apt.log" "$WORK/apt-update.rc"
check_rc "apt-get update" "$WORK/apt.log" "$WORK/apt-update.rc"
log "apt-get upgrade + install ${#INCLUDE[@]} packages: ${INCLUDE[*]}"
{ in_root apt-get "${APT_OPTS[@]}" -y dist-upgrade 2>&1 && in_root apt-get "${APT_OPTS[@]}" -y install "${INCLUDE[@]}" 2>&1; echo "__rc=$?"; } \
  | progress apt "$WORK/apt.log" "$WORK/apt-install.rc"
check_rc "apt-get install" "$WORK/apt.log" "$WORK/apt-install.rc"
rm -f "$ROOT/usr/sbin/policy-rc.d"
log "packages installed ($(elapsed)), tree is $(du -smx "$ROOT" | cut -f1) MiB"

# --- configure the tree ------------------------------------------------------------
log "configuring user, sudo, hostname, python"

if ! in_root getent group user >/dev/null; then
  in_root groupadd --gid 1000 user
fi
if ! in_root getent passwd user >/dev/null; then
  in_root useradd --uid 1000 --gid 1000 --home-dir /workspace --no-create-home \
    --shell /bin/bash user
fi
in_root passwd -d user >/dev/null 2>&1 || true
mkdir -p "$ROOT/workspace"
# copy the skeleton dotfiles (.bashrc, .profile) into the home
cp -a "$ROOT/etc/skel/." "$ROOT/workspace/" 2>/dev/null || true
chown -R 1000:1000 "$ROOT/workspace"
chmod 0755 "$ROOT/workspace"

mkdir -p "$ROOT/etc/sudoers.d"
printf 'user ALL=(ALL) NOPASSWD:ALL\n' >"$ROOT/etc/sudoers.d/user"
chmod 0440 "$ROOT/etc/sudoers.d/user"
chown 0:0 "$ROOT/etc/sudoers.d/user"

# pip install without --break-system-packages
rm -f "$ROOT"/usr/lib/python3*/EXTERNALLY-MANAGED

printf 'sandbox\n' >"$ROOT/etc/hostname"
cat >"$ROOT/etc/hosts" <<'EOF'
127.0.0.1	localhost
127.0.1.1	sandbox
::1		localhost ip6-localhost ip6-loopback
ff02::1		ip6-allnodes
ff02::2		ip6-allrouters
EOF
# empty machine-id: every sandbox is its own machine
: >"$ROOT/etc/machine-id"
rm -f "$ROOT/var/lib/dbus/machine-id"
# the guest has no network card; drop the host's resolver settings debootstrap copied
rm -f "$ROOT/etc/resolv.conf"
: >"$ROOT/etc/resolv.conf"
# root on /dev/vda, no fstab entries needed beyond it
cat >"$ROOT/etc/fstab" <<'EOF'
# <file system> <mount point> <type> <options> <dump> <pass>
/dev/vda	/	ext4	rw,relatime	0	1
EOF

# --- slim down -------------------------------------------------------------------
log "cleaning apt caches, docs and man pages"
in_root apt-get clean >/dev/null 2>&1 || true
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/cache/apt/archives/partial/* \
  "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/lib/apt/lists/* \
  "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* \
  "$ROOT"/var/log/*.log "$ROOT"/var/log/apt/* "$ROOT"/var/cache/debconf/*-old \
  "$ROOT"/var/cache/man/* "$ROOT"/tmp/* "$ROOT"/var/tmp/* "$ROOT"/root/.cache
mkdir -p "$ROOT/var/lib/apt/lists/partial"
# Parts of the toolchains no user build reads, so that the smallest disk
# (3072 MiB) keeps room: Go's own tests and test data, the sources and
# compiled archives of the Go toolchain's commands (its binaries stay in
# pkg/tool), and the JDK's jmods (only jlink reads them). About 280 MiB.
find "$ROOT"/usr/share/go-*/src \( -name '*_test.go' -o \( -type d -name testdata -prune \) \) \
  -exec rm -rf {} + 2>/dev/null || true
rm -rf "$ROOT"/usr/share/go-*/src/cmd "$ROOT"/usr/share/go-*/test "$ROOT"/usr/lib/go-*/pkg/*/cmd \
  "$ROOT"/usr/lib/jvm/*/jmods

for m in dev/pts dev sys proc; do
  umount "$ROOT/$m" 2>/dev/null || umount -l "$ROOT/$m"
done

# no immutable/append-only attributes anywhere (root must be able to write later)
if command -v chattr >/dev/null; then
  chattr -R -i -a "$ROOT" 2>/dev/null || true
fi
log "tree is $(du -smx "$ROOT" | cut -f1) MiB after cleanup ($(elapsed))"

# --- image -------------------------------------------------------------------------
log "mkfs.ext4 -d (size $IMAGE_SIZE, sparse)"
rm -f "$OUT_DIR/rootfs.ext4.partial"
mkfs.ext4 -q -F -L root -d "$ROOT" "$OUT_DIR/rootfs.ext4.partial" "$IMAGE_SIZE" >/dev/null
e2fsck -fn "$OUT_DIR/rootfs.ext4.partial" >/dev/null 2>&1 || die "e2fsck reports errors in the new image"
mv -f "$OUT_DIR/rootfs.ext4.partial" "$OUT_DIR/rootfs.ext4"
log "done ($(elapsed)): $OUT_DIR/rootfs.ext4, $(du -m "$OUT_DIR/rootfs.ext4" | cut -f1) MiB allocated of $IMAGE_SIZE"
