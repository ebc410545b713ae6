# Unpacks an image's layers (plain tars, in order) onto a blank file system,
# as root, inside a throwaway machine: whiteouts (.wh.<name>) and opaque
# directories (.wh..wh..opq) applied before each layer's files, owners,
# modes, links and xattrs kept. Extraction runs chrooted in the target, so
# a layer's absolute symlinks resolve inside the image, never outside it.
# Then the tree gets what a sandbox needs: the user uid 1000 (`runtime`,
# home /workspace) when it has none, /workspace owned by it, resolv.conf
# and hosts. Usage: python3 unpack.py <dir of NNN.tar> <target>
import os, shutil, stat, sys, tarfile, pwd, grp  # noqa: F401 (loaded before chroot)

src, dst = sys.argv[1], sys.argv[2]
# The host's static busybox, when it sent one: supplied to an image with no
# shell at all (distroless) as /usr/lib/runtime/busybox with its applets
# linked in /usr/lib/runtime/bin (docs/images.md, "Images without a shell").
SUPPLIED = "/usr/lib/runtime"
busybox, applets = None, []
if os.path.isfile(os.path.join(src, "busybox")) and os.path.isfile(os.path.join(src, "busybox.list")):
    busybox = open(os.path.join(src, "busybox"), "rb").read()
    applets = sorted(set(open(os.path.join(src, "busybox.list")).read().split()) - {"busybox"})
names = sorted(n for n in os.listdir(src) if n.endswith(".tar"))
tars = [tarfile.open(os.path.join(src, n), "r:") for n in names]
resolv = open("/etc/resolv.conf", "rb").read() if os.path.exists("/etc/resolv.conf") else b""
os.chown(dst, 0, 0)
os.chmod(dst, 0o755)
lost = os.path.join(dst, "lost+found")
if os.path.isdir(lost) and not os.listdir(lost):
    os.rmdir(lost)
# Nothing may be imported once inside the image: its files are not ours.
sys.path.clear()
sys.dont_write_bytecode = True
os.chroot(dst)
os.chdir("/")


def clean(name):
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        return None
    return "/" + "/".join(parts)


def remove(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def parent_is_dir(path):
    d = os.path.dirname(path)
    if os.path.isdir(d):
        return True
    # A file or a dangling link where the parent should be: Docker
    # replaces it with the directory.
    if os.path.lexists(d) and not os.path.isdir(d):
        remove(d)
    os.makedirs(d, exist_ok=True)
    return True


count = 0
for i, t in enumerate(tars):
    members = t.getmembers()
    # Whiteouts refer to lower layers: apply them before this layer's files.
    for m in members:
        p = clean(m.name)
        if p is None:
            continue
        base = os.path.basename(p)
        if base == ".wh..wh..opq":
            d = os.path.dirname(p)
            if os.path.isdir(d) and not os.path.islink(d):
                for e in os.listdir(d):
                    remove(os.path.join(d, e))
        elif base.startswith(".wh."):
            remove(os.path.join(os.path.dirname(p), base[4:]))
    for m in members:
        p = clean(m.name)
        if p is None or p == "/" and not m.isdir():
            print(f"layer {i + 1}: skipped {m.name!r}", flush=True)
            continue
        if os.path.basename(p).startswith(".wh."):
            continue
        m.name = p.lstrip("/") or "."
        if m.islnk():
            lp = clean(m.linkname)
            if lp is None:
                print(f"layer {i + 1}: skipped hard link {m.name!r}", flush=True)
                continue
            m.linkname = lp.lstrip("/")
        if p != "/":
            parent_is_dir(p)
            try:
                st = os.lstat(p)
                if not (m.isdir() and stat.S_ISDIR(st.st_mode)):
                    remove(p)
            except FileNotFoundError:
                pass
        try:
            t.extract(m, "/", set_attrs=True, numeric_owner=True, filter="fully_trusted")
        except (OSError, tarfile.TarError) as e:
            print(f"layer {i + 1}: {m.name}: {e}", flush=True)
            continue
        for k, v in m.pax_headers.items():
            if k.startswith("SCHILY.xattr."):
                try:
                    os.setxattr(p, k[13:], v.encode("utf-8", "surrogateescape"), follow_symlinks=False)
                except OSError:
                    pass
        count += 1
    print(f"layer {i + 1}/{len(tars)}: {len(members)} entries", flush=True)

# What a sandbox needs.
os.makedirs("/etc", exist_ok=True)

def supply_shell():
    """Our busybox for an image with no /bin/sh (nor /usr/bin/sh): its
    `sh` and applets under SUPPLIED, where the agent looks when a command
    needs a shell the image lacks. Answers the shell's path, or None."""
    if busybox is None or os.path.exists("/bin/sh") or os.path.exists("/usr/bin/sh"):
        return None
    os.makedirs(SUPPLIED + "/bin", exist_ok=True)
    remove(SUPPLIED + "/busybox")
    with open(SUPPLIED + "/busybox", "wb") as f:
        f.write(busybox)
    os.chmod(SUPPLIED + "/busybox", 0o755)
    for a in applets:
        if "/" not in a:
            remove(SUPPLIED + "/bin/" + a)
            os.symlink("../busybox", SUPPLIED + "/bin/" + a)
    print(f"the image has no shell: supplied busybox ({len(applets)} applets) at {SUPPLIED}", flush=True)
    return SUPPLIED + "/bin/sh"


supplied_sh = supply_shell()
shell = "/bin/bash" if os.path.exists("/bin/bash") else supplied_sh or "/bin/sh"


def has_id(path, want):
    try:
        for line in open(path, encoding="utf-8", errors="replace"):
            f = line.split(":")
            if len(f) > 2 and f[2] == want:
                return True
    except FileNotFoundError:
        pass
    return False


def append(path, line):
    text = open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else ""
    if text and not text.endswith("\n"):
        text += "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + line + "\n")


if not has_id("/etc/passwd", "0"):
    append("/etc/passwd", "root:x:0:0:root:/root:" + shell)
if not has_id("/etc/group", "0"):
    append("/etc/group", "root:x:0:")
if not has_id("/etc/passwd", "1000"):
    append("/etc/passwd", "runtime:x:1000:1000:runtime:/workspace:" + shell)
    if os.path.exists("/etc/shadow"):
        append("/etc/shadow", "runtime:*:19000:0:99999:7:::")
if not has_id("/etc/group", "1000"):
    append("/etc/group", "runtime:x:1000:")
for d in ("/workspace", "/tmp", "/root"):
    os.makedirs(d, exist_ok=True)
os.chown("/workspace", 1000, 1000)
os.chmod("/tmp", 0o1777)
if os.path.islink("/etc/resolv.conf") or not os.path.exists("/etc/resolv.conf") \
        or os.path.getsize("/etc/resolv.conf") == 0:
    remove("/etc/resolv.conf")
    open("/etc/resolv.conf", "wb").write(resolv)
hosts = open("/etc/hosts").read() if os.path.isfile("/etc/hosts") and not os.path.islink("/etc/hosts") else ""
if "localhost" not in hosts:
    remove("/etc/hosts")
    open("/etc/hosts", "w").write(hosts + "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
os.sync()
print(f"unpacked {count} entries", flush=True)
