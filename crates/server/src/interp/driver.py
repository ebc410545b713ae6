# The interpreter driver for Python and Bash contexts (crates/server/src/interpreter.rs).
# Started as `python3 -u -c DRIVER python|bash`; the first stdin line is a
# per-process nonce. Each later stdin line is one run: {"id": ..., "code": ...}.
# Protocol lines go to the original stdout, each `NONCE {json}\n`; fds 1 and 2
# are replaced by pipes read by threads, so everything the code (or a child
# process) prints travels as JSON `stdout`/`stderr` events and cannot forge a
# protocol line. SIGINT (a timeout or an interrupt) raises KeyboardInterrupt.
import ast, base64, codecs, io, json, linecache, os, subprocess, sys, threading, traceback, warnings

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
        self.synced = threading.Event()
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def out(self, b, final=False):
        t = self.dec.decode(b, final)
        if t:
            emit({"k": self.kind, "text": t})

    def run(self):
        buf = b""
        while True:
            chunk = os.read(self.r, 65536)
            if not chunk:
                return
            buf += chunk
            while True:
                i = buf.find(SYNC)
                if i < 0:
                    break
                self.out(buf[:i], True)
                buf = buf[i + len(SYNC):]
                self.synced.set()
            keep = 0
            for n in range(min(len(SYNC) - 1, len(buf)), 0, -1):
                if SYNC.startswith(buf[-n:]):
                    keep = n
                    break
            self.out(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep:]

    def sync(self):
        self.synced.clear()
        os.write(self.fd, SYNC)
        self.synced.wait(10)


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


def run_bash(rid, code, n):
    b = bash()
    path = os.path.join(_cells, "cell-%d.sh" % n)
    with open(path, "w") as f:
        f.write(code if code.endswith("\n") else code + "\n")
    line = b""
    try:
        b.stdin.write(("trap 'return 130 2>/dev/null' INT; source %s; printf '%%s\\n' \"$?\" >&%d\n" % (path, b.status_fd)).encode())
        b.stdin.flush()
        line = _status_r.readline()
    except KeyboardInterrupt as e:
        # The signal reached bash's whole group too: wait for the cell's end.
        try:
            line = _status_r.readline()
        except KeyboardInterrupt:
            pass
        flush_all()
        return "error", [{"k": "error", "name": "KeyboardInterrupt", "value": "interrupted",
                          "traceback": ""}]
    except BrokenPipeError:
        pass
    flush_all()
    if not line:
        return "error", [{"k": "error", "name": "BashExited", "value": "bash exited", "traceback": ""}]
    rc = int(line.strip() or 0)
    if rc != 0:
        return "error", [{"k": "error", "name": "ExitStatus", "value": "exit status %d" % rc,
                          "traceback": ""}]
    return "ok", []


def main():
    emit({"k": "ready", "pid": os.getpid(), "language": MODE})
    n = 0
    while True:
        try:
            line = _inp.readline()
        except KeyboardInterrupt:
            continue
        if not line:
            return
        try:
            req = json.loads(line)
        except ValueError:
            continue
        n += 1
        try:
            fn = run_bash if MODE == "bash" else run_python
            status, events = fn(req.get("id"), req.get("code", ""), n)
        except KeyboardInterrupt as e:
            status, events = "error", [error_event(e, 0)]
        for ev in events:
            emit(ev)
        emit({"k": "end", "id": req.get("id"), "status": status})


main()
