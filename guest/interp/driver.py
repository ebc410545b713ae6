# The interpreter driver for Python, Bash and Go contexts (crates/server/src/interpreter.rs).
# Started as `python3 -u -c DRIVER python|bash|go`; the first stdin line is a
# per-process nonce. Each later stdin line is one run: {"id": ..., "code": ...}.
# Protocol lines go to the original stdout, each `NONCE {json}\n`; fds 1 and 2
# are replaced by pipes read by threads, so everything the code (or a child
# process) prints travels as JSON `stdout`/`stderr` events and cannot forge a
# protocol line. SIGINT (a timeout or an interrupt) raises KeyboardInterrupt
# while a run is in progress; between runs it is ignored.
import ast, base64, codecs, io, json, linecache, os, queue, select, signal, subprocess, sys, threading, time, traceback, warnings

MODE = sys.argv[1] if len(sys.argv) > 1 else "python"
_inp = os.fdopen(os.dup(0), "rb", buffering=0)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
NONCE = _inp.readline().decode().strip()
SYNC = b"\x00" + NONCE.encode() + b"\x00"
_proto = os.dup(1)
_lock = threading.Lock()


def emit(obj):
    data = (NONCE + " " + json.dumps(obj) + "\n").encode()
    with _lock:
        while data:
            data = data[os.write(_proto, data):]


class Reader(threading.Thread):
    def __init__(self, fd, kind):
        super().__init__(daemon=True)
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        self.r, self.fd, self.kind = r, fd, kind
        # A marker is SYNC, 16 hex digits (the sync's monotonic clock in ns)
        # and NUL; `seen` is the latest one read, and each read puts a token.
        # SIGINT raises KeyboardInterrupt in the main thread at any bytecode,
        # so a sync keeps no count and takes no Python-level lock that an
        # interrupt could leave wrong or held (a threading.Event's inner
        # lock did: every later sync hung); SimpleQueue's get and put are
        # single C calls.
        self.seen = 0
        self.tokens = queue.SimpleQueue()
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def out(self, b, final=False):
        t = self.dec.decode(b, final)
        if t:
            emit({"k": self.kind, "text": t})

    def run(self):
        buf = b""
        whole = len(SYNC) + 17
        while True:
            chunk = os.read(self.r, 65536)
            if not chunk:
                return
            buf += chunk
            while True:
                i = buf.find(SYNC)
                if i < 0 or len(buf) < i + whole:
                    break
                self.out(buf[:i], True)
                self.seen = int(buf[i + len(SYNC):i + whole - 1], 16)
                buf = buf[i + whole:]
                self.tokens.put(None)
            if i >= 0:
                keep = len(buf) - i  # a marker not whole yet
            else:
                keep = 0
                for n in range(min(len(SYNC) - 1, len(buf)), 0, -1):
                    if SYNC.startswith(buf[-n:]):
                        keep = n
                        break
            self.out(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep:]

    def sync(self):
        """Returns once everything written to the fd before it has been
        emitted (or after 10 s): once a marker at least as new as its own
        has been read, whatever an interrupt cut short before."""
        mark = time.monotonic_ns()
        os.write(self.fd, SYNC + b"%016x\x00" % mark)
        deadline = time.monotonic() + 10
        while self.seen < mark:
            try:
                self.tokens.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return


os.environ.setdefault("MPLBACKEND", "Agg")
warnings.filterwarnings("ignore", message=".*non-interactive.*")
readers = [Reader(1, "stdout"), Reader(2, "stderr")]
for r in readers:
    r.start()


def flush_all():
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    for r in readers:
        r.sync()


def error_event(e, skip_frames=1):
    tb = e.__traceback__
    for _ in range(skip_frames):
        if tb is not None:
            tb = tb.tb_next
    if isinstance(e, SyntaxError):
        lines = traceback.format_exception_only(type(e), e)
    else:
        lines = traceback.format_exception(type(e), e, tb)
    return {"k": "error", "name": type(e).__name__, "value": str(e), "traceback": "".join(lines)}


# ---- Python ----------------------------------------------------------------
NS = {"__name__": "__main__", "__builtins__": __builtins__}
TABLE_ROWS = 1000


def jsonable(v):
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return str(v)


def table(df):
    head = df.head(TABLE_ROWS)
    parsed = json.loads(head.to_json(orient="split", date_format="iso", default_handler=str))
    return {
        "columns": [str(c) for c in df.columns],
        "index": parsed.get("index", []),
        "rows": parsed.get("data", []),
        "totalRows": int(len(df)),
        "truncated": len(df) > TABLE_ROWS,
    }


def bundle(value):
    data = {"text/plain": repr(value)}
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(value, pd.Series):
        value = value.to_frame()
    if pd is not None and isinstance(value, pd.DataFrame):
        data["text/html"] = value.to_html(max_rows=TABLE_ROWS)
        data["application/vnd.runtime.table+json"] = table(value)
        return data
    for attr, mime in (("_repr_html_", "text/html"), ("_repr_png_", "image/png"),
                       ("_repr_svg_", "image/svg+xml"), ("_repr_json_", "application/json"),
                       ("_repr_markdown_", "text/markdown")):
        fn = getattr(value, attr, None)
        if callable(fn) and not isinstance(value, type):
            try:
                out = fn()
            except Exception:
                continue
            if out is None:
                continue
            if mime == "image/png" and isinstance(out, bytes):
                out = base64.b64encode(out).decode()
            data[mime] = out
    return data


def figures():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    out = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        try:
            fig.savefig(buf, format="png", bbox_inches="tight")
            out.append({"k": "result", "main": False,
                        "data": {"image/png": base64.b64encode(buf.getvalue()).decode(),
                                 "text/plain": repr(fig)}})
        finally:
            plt.close(fig)
    return out


def run_python(rid, code, n):
    name = "<cell-%d>" % n
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    events, status = [], "ok"
    try:
        try:
            tree = ast.parse(code, name, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, name, "exec"), NS)
            value = eval(compile(last, name, "eval"), NS) if last is not None else None
            flush_all()
            figs = figures()
            events.extend(figs)
            plt = sys.modules.get("matplotlib.figure")
            if value is not None and not (plt is not None and isinstance(value, plt.Figure)):
                NS["_"] = value
                events.append({"k": "result", "main": True, "data": bundle(value)})
        except BaseException as e:  # KeyboardInterrupt and SystemExit included
            flush_all()
            status = "error"
            events.append(error_event(e))
            try:
                figures()
            except BaseException:
                pass
    except KeyboardInterrupt as e:  # a second interrupt while reporting
        status = "error"
        events.append(error_event(e, 0))
    return status, events


# ---- Bash ------------------------------------------------------------------
_bash = None
_status_r = None
_cells = "/tmp/.runtime-interp-%d" % os.getpid()


def bash():
    global _bash, _status_r
    if _bash is None or _bash.poll() is not None:
        r, w = os.pipe()
        os.makedirs(_cells, exist_ok=True)

        _bash = subprocess.Popen(["bash", "--norc", "--noprofile"], stdin=subprocess.PIPE,
                                 pass_fds=(w,), close_fds=True)
        os.close(w)
        _bash.status_fd = w
        _status_r = os.fdopen(r, "rb", buffering=0)
    return _bash


def bash_status(b, n, interrupted):
    """The status of cell n as bash prints it when the cell ends (b"" if
    bash is gone), and whether SIGINT came meanwhile. The signal reaches
    bash's whole group, but bash may drop the rest of the command line it
    was reading or running (the status, or a line sent after it), and one
    that comes while bash itself is busy (expanding the next command,
    looking it up) only runs its trap once that command ends, which may be
    never. So after an interrupt bash gets a line that prints the status,
    and while none comes, the group gets SIGINT again each second and bash
    another such line; the status lines of a cell after its first are left
    for the next runs, which skip them."""
    probe = b"printf '%%s %%s\\n' %d 130 >&%d\n" % (n, b.status_fd)
    probed = False
    while True:
        try:
            if interrupted:
                if not probed:
                    probed = True
                    b.stdin.write(probe)
                    b.stdin.flush()
                if not select.select([_status_r], [], [], 1.0)[0]:
                    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
                    try:
                        os.killpg(os.getpgrp(), signal.SIGINT)
                    finally:
                        signal.signal(signal.SIGINT, old)
                    time.sleep(0.05)  # bash takes the signal before the line
                    b.stdin.write(probe)
                    b.stdin.flush()
                    continue
            line = _status_r.readline()
            if not line:
                return b"", interrupted
            cell, _, status = line.partition(b" ")
            if cell == b"%d" % n:
                return status, interrupted
        except KeyboardInterrupt:
            interrupted = True


def run_bash(rid, code, n):
    b = bash()
    path = os.path.join(_cells, "cell-%d.sh" % n)
    with open(path, "w") as f:
        f.write(code if code.endswith("\n") else code + "\n")
    interrupted = False
    try:
        # The cell's stdin is /dev/null: bash reads its commands from its own.
        b.stdin.write(("trap 'return 130 2>/dev/null' INT; source %s </dev/null; printf '%%s %%s\\n' %d \"$?\" >&%d\n"
                       % (path, n, b.status_fd)).encode())
        while True:
            try:
                b.stdin.flush()
                break
            except KeyboardInterrupt:
                interrupted = True
        status, interrupted = bash_status(b, n, interrupted)
    except BrokenPipeError:
        status = b""
    flush_all()
    if not status:
        return "error", [{"k": "error", "name": "BashExited", "value": "bash exited", "traceback": ""}]
    if interrupted:
        return "error", [{"k": "error", "name": "KeyboardInterrupt", "value": "interrupted",
                          "traceback": ""}]
    rc = int(status.strip() or 0)
    if rc != 0:
        return "error", [{"k": "error", "name": "ExitStatus", "value": "exit status %d" % rc,
                          "traceback": ""}]
    return "ok", []


# ---- Go --------------------------------------------------------------------
# Go has no REPL. The context keeps the source of its successful cells: the
# top-level declarations (import, func, type, var, const) become the package,
# the other statements the body of main. A run builds the whole program and
# runs it: the statements of earlier cells first, with fds 1 and 2 on
# /dev/null, then the new cell's. A cell that fails to build or run is not
# kept. So variables persist by re-running the code that made them (side
# effects of earlier cells happen again, silently); see docs/interpreter.md.
import re

GO_KEYWORDS = ("if", "for", "switch", "select", "go", "defer", "return", "break", "continue",
               "goto", "fallthrough", "var", "const", "type", "func", "import", "package")
_go = {"imports": [], "decls": [], "stmts": []}
_go_dir = None
GO_PRELUDE = """
var __rtSaved [2]int

func __rtQuiet() {
	for i := range __rtSaved {
		__rtSaved[i], _ = __rt_syscall.Dup(i + 1)
	}
	if n, err := __rt_syscall.Open("/dev/null", __rt_syscall.O_WRONLY, 0); err == nil {
		__rt_syscall.Dup3(n, 1, 0)
		__rt_syscall.Dup3(n, 2, 0)
		__rt_syscall.Close(n)
	}
}

func __rtLoud() {
	for i, fd := range __rtSaved {
		__rt_syscall.Dup3(fd, i+1, 0)
		__rt_syscall.Close(fd)
	}
}

func __rtShow(v ...any) {
	__rt_os.Stdout.Sync()
	s := __rt_fmt.Sprint(v...)
	if len(v) == 1 {
		s = __rt_fmt.Sprintf("%#v", v[0])
		switch v[0].(type) {
		case int, int64, int32, float64, float32, bool, uint, uint64, []int, []string, []float64, map[string]int, error:
			s = __rt_fmt.Sprint(v[0])
		}
	}
	if len(s) > 60000 {
		s = s[:60000]
	}
	var fd uintptr
	__rt_fmt.Sscan(__rt_os.Getenv("RUNTIME_RESULT_FD"), &fd)
	__rt_os.NewFile(fd, "result").WriteString(s)
}
"""


def go_split(code):
    """(imports, decls, stmts, decl_lines, stmt_lines) of a cell: top-level
    items start at column 0; the lines (1-based) are where each declaration
    starts and where each statement is in the cell."""
    imports, decls, stmts, decl_lines, stmt_lines = [], [], [], [], []
    lines = code.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        word = re.match(r"(import|func|type|var|const|package)\b", line)
        if not word:
            stmts.append(line)
            stmt_lines.append(i + 1)
            i += 1
            continue
        start = i + 1
        # the item runs until its brackets close
        depth, j, chunk = 0, i, []
        while j < len(lines):
            chunk.append(lines[j])
            depth += go_depth(lines[j])
            j += 1
            if depth <= 0:
                break
        i = j
        text = "\n".join(chunk)
        kind = word.group(1)
        if kind == "package":
            continue
        if kind == "import":
            body = text[len("import"):].strip()
            if body.startswith("("):
                body = body[1:body.rfind(")")]
            imports.extend(l.strip() for l in re.split(r"[\n;]", body) if l.strip() and not l.strip().startswith("//"))
        elif kind == "func" and re.match(r"func\s+main\s*\(", text):
            decls.append(re.sub(r"func\s+main", "func __rtUserMain", text, count=1))
            decl_lines.append(start)
            stmts.append("__rtUserMain()")
            stmt_lines.append(start)
        else:
            decls.append(text)
            decl_lines.append(start)
    return imports, decls, stmts, decl_lines, stmt_lines


def go_depth(line):
    """The bracket depth a line adds, outside strings, runes and comments."""
    depth, k, n = 0, 0, len(line)
    while k < n:
        c = line[k]
        if c == "/" and line[k:k + 2] == "//":
            break
        if c in "\"'`":
            end = line.find(c, k + 1) if c == "`" else k + 1
            if c != "`":
                while end < n and line[end] != c:
                    end += 2 if line[end] == "\\" else 1
            k = (end if end >= 0 else n) + 1
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        k += 1
    return depth


def go_used(imports, text):
    out = []
    for spec in imports:
        m = re.match(r'(?:([\w.]+)\s+)?"([^"]+)"', spec)
        if not m:
            continue
        name = m.group(1) or m.group(2).rstrip("/").split("/")[-1]
        if name in ("_", ".") or re.search(r"\b%s\." % re.escape(name), text):
            out.append(spec)
    return out


def go_program(imports, decls, old, new):
    """The program's source, the line where the new cell's statements start
    and the line where the declarations start."""
    body = "\n".join(decls)
    used = go_used(imports, body + "\n" + "\n".join(old + new))
    head = ["package main", "", "import (", '\t__rt_fmt "fmt"', '\t__rt_os "os"',
            '\t__rt_syscall "syscall"'] + ["\t" + s for s in dict.fromkeys(used)] + [")", ""]
    src = head + body.splitlines() + GO_PRELUDE.splitlines() + ["", "func main() {", "\t__rtQuiet()"]
    src += old + ["\t__rtLoud()", "\t_ = __rt_fmt.Sprint", "\t_ = __rt_os.Stdout"]
    first = len(src) + 1
    return "\n".join(src + new + ["}", ""]), first, len(head) + 1


def go_uses(stmts):
    """`_ = x` for each variable a cell's statements declare with := at the top."""
    out = []
    for line in stmts:
        m = re.match(r"\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:=", line)
        if m and go_depth_before(stmts, line) == 0:
            out += ["_ = %s" % v.strip() for v in m.group(1).split(",") if v.strip() != "_"]
        m = re.match(r"\s*var\s+([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)", line)
        if m and go_depth_before(stmts, line) == 0:
            out += ["_ = %s" % v.strip() for v in m.group(1).split(",") if v.strip() != "_"]
    return out


def go_depth_before(stmts, line):
    depth = 0
    for l in stmts:
        if l is line:
            return depth
        depth += go_depth(l)
    return depth


def go_last_value(stmts):
    """The statements with a final bare expression turned into a result."""
    idx = len(stmts) - 1
    while idx >= 0 and not stmts[idx].strip():
        idx -= 1
    if idx < 0 or go_depth_before(stmts, stmts[idx]) != 0:
        return stmts, False
    line = stmts[idx].strip().rstrip(";")
    if go_depth(line) != 0 or line.endswith("{") or line.startswith("//"):
        return stmts, False
    if re.match(r"(%s)\b" % "|".join(GO_KEYWORDS), line):
        return stmts, False
    if re.search(r"(:=|<-|\+\+$|--$|(?<![=!<>])=(?!=)|[-+*/%&|^]=)", line):
        return stmts, False
    call = re.match(r"[\w.]+\(.*\)$", line)
    if call and not re.match(r"(len|cap|min|max|append|string|int|int64|float64|strings\.\w+|strconv\.\w+|fmt\.Sprint\w*|math\.\w+)\(", line):
        return stmts, False
    return stmts[:idx] + ["\t__rtShow(%s)" % line] + stmts[idx + 1:], True


def go_env():
    env = dict(os.environ)
    if not env.get("GOCACHE"):
        base = env.get("XDG_CACHE_HOME") or (os.path.join(env["HOME"], ".cache") if env.get("HOME") else None)
        env["GOCACHE"] = os.path.join(base or _go_dir, "go-build")
    env.setdefault("GOPATH", os.path.join(env.get("HOME") or _go_dir, "go"))
    env.setdefault("GOFLAGS", "-mod=mod")
    env.setdefault("GOTOOLCHAIN", "local")
    env.setdefault("GOPROXY", "off")
    env.setdefault("CGO_ENABLED", "0")
    return env


def go_relines(text, linemap, n):
    """Compiler messages and traces with the new cell's lines as `cell-N.go:L:C`."""
    def sub(m):
        line = linemap.get(int(m.group(1)))
        return "cell-%d.go:%d%s" % (n, line, m.group(2) or "") if line else m.group(0)
    return re.sub(r"\S*main\.go:(\d+)(:\d+)?", sub, text)


def run_go(rid, code, n):
    global _go_dir
    if _go_dir is None:
        _go_dir = "/tmp/.runtime-go-%d" % os.getpid()
        os.makedirs(_go_dir, exist_ok=True)
    imports, decls, stmts, decl_lines, stmt_lines = go_split(code)
    new, shows = go_last_value(["\t" + s for s in stmts])
    new += ["\t" + s for s in go_uses(stmts)]
    all_imports = _go["imports"] + imports
    all_decls = _go["decls"] + decls
    src, first, body = go_program(all_imports, all_decls, _go["stmts"], new)
    linemap = {}
    at = body + sum(d.count("\n") + 1 for d in _go["decls"])
    for text, line in zip(decls, decl_lines):
        for k in range(text.count("\n") + 1):
            linemap[at + k] = line + k
        at += text.count("\n") + 1
    for k in range(len(new)):
        linemap[first + k] = stmt_lines[min(k, len(stmt_lines) - 1)] if stmt_lines else 1
    path = os.path.join(_go_dir, "main.go")
    exe = os.path.join(_go_dir, "cell")
    with open(path, "w") as f:
        f.write(src)
    env = go_env()
    proc = None
    try:
        proc = subprocess.Popen(["go", "build", "-o", exe, path], cwd=_go_dir, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = proc.communicate()[0].decode("utf-8", "replace")
        if proc.returncode != 0:
            out = go_relines(out, linemap, n)
            msgs = [l for l in out.splitlines() if re.match(r"\S+:\d+:\d+: ", l)]
            value = re.sub(r"^\S+:\d+:\d+: ", "", msgs[0]) if msgs else out.strip()
            return "error", [{"k": "error", "name": "CompileError", "value": value, "traceback": out}]
        r, w = os.pipe()
        proc = subprocess.Popen([exe], env=dict(os.environ, RUNTIME_RESULT_FD=str(w)), pass_fds=(w,),
                                stderr=subprocess.PIPE)
        os.close(w)
        tail = bytearray()
        while True:
            chunk = proc.stderr.read1(65536) if hasattr(proc.stderr, "read1") else proc.stderr.read(65536)
            if not chunk:
                break
            os.write(2, chunk)
            tail += chunk
            del tail[:-65536]
        proc.wait()
        shown = os.read(r, 1 << 20)
        os.close(r)
    except KeyboardInterrupt:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        flush_all()
        return "error", [{"k": "error", "name": "KeyboardInterrupt", "value": "interrupted", "traceback": ""}]
    flush_all()
    if proc.returncode != 0:
        text = tail.decode("utf-8", "replace")
        m = re.search(r"^panic: (.*)$", text, re.M)
        if m:
            return "error", [{"k": "error", "name": "Panic", "value": m.group(1),
                              "traceback": go_relines(text, linemap, n)}]
        return "error", [{"k": "error", "name": "ExitStatus", "value": "exit status %d" % proc.returncode,
                          "traceback": ""}]
    _go["imports"], _go["decls"] = all_imports, all_decls
    _go["stmts"] = _go["stmts"] + [l for l in new if "__rtShow(" not in l]
    events = []
    if shows and shown:
        events.append({"k": "result", "main": True, "data": {"text/plain": shown.decode("utf-8", "replace")}})
    return "ok", events


def between_runs(signum, frame):
    """SIGINT while no run is in progress (a timeout that fired as the run
    ended) is not for the next run; raised as KeyboardInterrupt it would have
    ended the driver, or cut a protocol line in two."""


def main():
    emit({"k": "ready", "pid": os.getpid(), "language": MODE})
    fn = {"bash": run_bash, "go": run_go}.get(MODE, run_python)
    # The handler while a run is in progress: KeyboardInterrupt, or whatever
    # the code installed (it stays for the next runs).
    handler = signal.signal(signal.SIGINT, between_runs)
    n = 0
    while True:
        line = _inp.readline()
        if not line:
            return
        try:
            req = json.loads(line)
        except ValueError:
            continue
        n += 1
        try:
            try:
                signal.signal(signal.SIGINT, handler)
                status, events = fn(req.get("id"), req.get("code", ""), n)
            finally:
                handler = signal.signal(signal.SIGINT, between_runs)
        except KeyboardInterrupt as e:
            signal.signal(signal.SIGINT, between_runs)
            status, events = "error", [error_event(e, 0)]
        if status != "ok":
            # An interrupt may have cut the run's own flush short: what it
            # printed goes out before its end (no interrupt raises here).
            flush_all()
        for ev in events:
            emit(ev)
        emit({"k": "end", "id": req.get("id"), "status": status})


main()
