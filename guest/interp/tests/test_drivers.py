"""The interpreter drivers of guest/interp over their line protocol, started on
this host as the server starts them in the guest (see driver_harness.py):
ready, state kept between runs, stdout and stderr, output without a final
newline, the last value, errors that keep the context, output that imitates a
protocol line, SIGINT that stops a run and keeps the state.

One driver per language for the module (the JVM and R start slowly); each
test uses its own names, so what it asserts does not depend on the others. A
driver that died, or that a failed test used, is started again for the next
test."""
from __future__ import annotations

import json
import threading
import time

import pytest

from driver_harness import Driver

LANGUAGES = ["python", "bash", "go", "javascript", "typescript", "r", "java"]

# How long an interrupted run may take to end: the server kills the driver
# after INTERRUPT_GRACE (10 s) and its state is gone.
INTERRUPT_GRACE = 10


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    started: dict[str, Driver] = {}
    yield started, tmp_path_factory.mktemp("cwd")
    for d in started.values():
        d.close()


@pytest.fixture
def pool(drivers, request):
    """The module's driver of a language, started on first use."""
    started, cwd = drivers
    used = set()

    def get(language: str) -> Driver:
        d = started.get(language)
        if d is None or not d.alive():
            if d is not None:
                d.close()
            d = started[language] = Driver(language, cwd)
        used.add(language)
        return d

    yield get
    rep = getattr(request.node, "rep_call", None)
    if rep is None or rep.failed:  # it may be out of step with its runs
        for language in used:
            started.pop(language).close()


def ok(run, stdout="", stderr=""):
    """A run that ended `ok` with exactly this output and no other event."""
    assert run.end["status"] == "ok", run
    assert run.kinds() <= {"stdout", "stderr"}, run
    assert (run.stdout, run.stderr) == (stdout, stderr), run


# A run that prints "ok": the context still answers.
AFTER = {
    "python": "print('ok')",
    "bash": "echo ok",
    "go": 'import "fmt"\nfmt.Println("ok")',
    "javascript": "console.log('ok');",
    "typescript": "console.log('ok');",
    "r": 'cat("ok\\n")',
    "java": 'System.out.println("ok");',
}


@pytest.mark.parametrize("language", LANGUAGES)
def test_ready(pool, language):
    d = pool(language)
    assert d.ready == {"k": "ready", "pid": d.proc.pid, "language": language}


STATE = {
    "python": ("counter_a = 41", "print(counter_a + 1)"),
    "bash": ("counter_a=41", "echo $((counter_a + 1))"),
    "go": ("counter_a := 41", 'import "fmt"\nfmt.Println(counter_a + 1)'),
    "javascript": ("let counter_a = 41;", "console.log(counter_a + 1);"),
    "typescript": ("let counter_a: number = 41;", "console.log(counter_a + 1);"),
    "r": ("counter_a <- 41", 'cat(counter_a + 1, "\\n", sep = "")'),
    "java": ("int counter_a = 41;", "System.out.println(counter_a + 1);"),
}


@pytest.mark.parametrize("language", LANGUAGES)
def test_state_persists(pool, language):
    d = pool(language)
    first, second = STATE[language]
    ok(d.run(first))
    ok(d.run(second), stdout="42\n")


OUTPUT = {
    "python": 'import sys\nprint("to out")\nprint("to err", file=sys.stderr)',
    "bash": "echo to out\necho to err >&2",
    "go": 'import (\n\t"fmt"\n\t"os"\n)\nfmt.Println("to out")\nfmt.Fprintln(os.Stderr, "to err")',
    "javascript": 'console.log("to out"); console.error("to err");',
    "typescript": 'const out_b: string = "to out"; console.log(out_b); console.error("to err");',
    "r": 'cat("to out\\n"); message("to err")',
    "java": 'System.out.println("to out"); System.err.println("to err");',
}


@pytest.mark.parametrize("language", LANGUAGES)
def test_stdout_and_stderr(pool, language):
    r = pool(language).run(OUTPUT[language])
    ok(r, stdout="to out\n", stderr="to err\n")
    assert {e["k"] for e in r.events if e["text"].strip() == "to err"} == {"stderr"}, r


NO_NEWLINE = {
    "python": 'print("no newline", end="")',
    "bash": "printf 'no newline'",
    "go": 'import "fmt"\nfmt.Print("no newline")',
    "javascript": 'void process.stdout.write("no newline");',
    "typescript": 'void process.stdout.write("no newline");',
    "r": 'cat("no newline")',
    "java": 'System.out.print("no newline");',
}


@pytest.mark.parametrize("language", ["python", "bash", "go", "javascript", "typescript", "r", "java"])
def test_output_without_newline(pool, language):
    """The run's `end` still starts a line of its own: the server takes a
    line for a protocol line only when it starts with the nonce."""
    d = pool(language)
    ok(d.run(NO_NEWLINE[language]), stdout="no newline")
    ok(d.run(AFTER[language]), stdout="ok\n")


def test_r_output_is_relayed_exactly(pool):
    """R's fd 1 goes through the driver's relay: bytes arrive as they were
    written, UTF-8 cut between two writes whole, invalid bytes as U+FFFD,
    control characters and NUL escaped, long output complete."""
    d = pool("r")
    euro = "rawToChar(as.raw(c(0xe2, 0x82)))"
    code = (f"cat({euro}); flush(stdout()); Sys.sleep(0.3); cat(rawToChar(as.raw(0xac)), '\\n', sep = '')\n"
            "cat(rawToChar(as.raw(c(0x61, 0xff, 0x62, 0x0a))))\n"
            "cat('tab\\there\\001\\n')\n"
            "invisible(system(\"printf 'nul\\\\000byte\\\\n'\"))\n"
            "cat(strrep('x', 200000), '\\n', sep = '')")
    ok(d.run(code), stdout="\u20ac\n" "a\ufffdb\n" "tab\there\x01\n" "nul\x00byte\n" + "x" * 200000 + "\n")


def test_js_output_is_relayed_exactly(pool):
    """JavaScript's fds 1 and 2 go through the driver's worker thread: a
    child process that writes more than a pipe holds while the script waits
    for it does not block, UTF-8 cut between two writes arrives whole, and
    the child's stderr arrives before the run's end."""
    d = pool("javascript")
    code = ("const cp = require('child_process');\n"
            "cp.execFileSync('sh', ['-c', 'head -c 300000 /dev/zero | tr \"\\\\000\" x; echo'], {stdio: 'inherit'});\n"
            "process.stdout.write(Buffer.from([0xe2, 0x82])); process.stdout.write(Buffer.from([0xac, 0x0a]));\n"
            "cp.execFileSync('sh', ['-c', 'echo to err >&2'], {stdio: 'inherit'});\n"
            "void 0;")
    ok(d.run(code), stdout="x" * 300000 + "\n\u20ac\n", stderr="to err\n")


# The last value: code, and its `text/plain` (None: the language has none).
RESULT = {
    "python": ("6 * 7", "42"),
    "bash": ("echo 42", None),
    "go": ("6 * 7", "42"),
    "javascript": ("[6 * 7, 'x']", "[ 42, 'x' ]"),
    "typescript": ("(6 * 7) as number", "42"),
    "r": ("6 * 7", "[1] 42"),
    "java": ('"ab" + 6 * 7', '"ab42"'),
}


@pytest.mark.parametrize("language", LANGUAGES)
def test_result(pool, language):
    code, text = RESULT[language]
    r = pool(language).run(code)
    assert r.end["status"] == "ok", r
    if text is None:
        assert r.of("result") == [] and r.stdout == "42\n", r
    else:
        assert r.of("result") == [{"k": "result", "main": True, "data": {"text/plain": text}}], r
        assert r.stdout == "" and r.stderr == "", r


# (define, fail, read back, the error's name and value)
ERROR = {
    "python": ("kept_c = 'c'", "print('before')\n1 / 0", "print(kept_c)",
               "ZeroDivisionError", "division by zero"),
    "bash": ("kept_c=c", "echo before\n(exit 3)", "echo $kept_c", "ExitStatus", "exit status 3"),
    "go": ('var kept_c = "c"', 'import "fmt"\nfmt.Println("before")\npanic("boom")',
           'import "fmt"\nfmt.Println(kept_c)', "Panic", "boom"),
    "javascript": ("var kept_c = 'c';", "console.log('before'); throw new RangeError('boom');",
                   "console.log(kept_c);", "RangeError", "boom"),
    "typescript": ("var kept_c: string = 'c';",
                   "console.log('before'); throw new RangeError('boom');",
                   "console.log(kept_c);", "RangeError", "boom"),
    "r": ('kept_c <- "c"', 'cat("before\\n"); stop("boom")', 'cat(kept_c, "\\n", sep = "")',
          "simpleError", "boom"),
    "java": ('String kept_c = "c";',
             'System.out.println("before"); if (true) throw new IllegalStateException("boom");',
             "System.out.println(kept_c);", "java.lang.IllegalStateException", "boom"),
}


@pytest.mark.parametrize("language", LANGUAGES)
def test_error_keeps_context(pool, language):
    d = pool(language)
    define, fail, read, name, value = ERROR[language]
    ok(d.run(define))
    r = d.run(fail)
    assert r.end["status"] == "error", r
    assert [(e["name"], e["value"]) for e in r.of("error")] == [(name, value)], r
    assert r.stdout == "before\n", r
    assert r.kinds() <= {"stdout", "stderr", "error"}, r
    ok(d.run(read), stdout="c\n")


def forge_code(language: str, text: str) -> str:
    """Code that has a child process write `text` to the driver's fd 1 (for
    bash and Go the shell and the program are that child), then prints
    "after\\n" itself. Java prints it with System.out: the JVM cannot put
    anything else on its fd 1, so a child started with inheritIO() writes to
    the protocol stream itself."""
    q = json.dumps(text)
    sh = "printf '%s' '" + text.replace("'", "'\\''") + "'"
    return {
        "python": f"import subprocess\nsubprocess.run({json.dumps(['sh', '-c', sh])}, check=True)\n"
                  "print('after')",
        "bash": f"{sh}\necho after",
        "go": f'import (\n\t"fmt"\n\t"os"\n)\nos.Stdout.WriteString({q})\nfmt.Println("after")',
        "javascript": f"require('child_process').execFileSync('sh', ['-c', {json.dumps(sh)}], "
                      "{stdio: 'inherit'});\nconsole.log('after');",
        "typescript": "import { execFileSync } from 'child_process';\n"
                      f"execFileSync('sh', ['-c', {json.dumps(sh)}], {{stdio: 'inherit'}});\n"
                      "console.log('after');",
        "r": f"system({json.dumps(sh)})\ncat('after\\n')",
        "java": f'System.out.print({q});\nSystem.out.println("after");',
    }[language]


@pytest.mark.parametrize("language", LANGUAGES)
def test_output_imitating_protocol_lines(pool, language):
    """Lines with the real nonce that a child process prints are output: they
    neither end the run (not even an `end` with the run's id) nor add events;
    a last one without a newline does not swallow the driver's next line."""
    d = pool(language)
    rid = "exec_" + "f" * 32
    n = d.nonce
    text = (f'{n} {{"k":"end"}}\n'
            f'{n} {{"k":"end","id":"{rid}","status":"ok"}}\n'
            f'{n} {{"k":"error","name":"Forged","value":"x","traceback":""}}\n'
            f'{n} {{"k":"result","main":true,"data":{{"text/plain":"forged"}}}}\n'
            f'{n} {{"k":"stdout","text":"forged"}}\n'
            "no newline ")
    r = d.run(forge_code(language, text), rid=rid)
    assert r.end == {"k": "end", "id": rid, "status": "ok"}, r
    assert r.stdout == text + "after\n", r
    assert r.kinds() == {"stdout"}, r
    ok(d.run(AFTER[language]), stdout="ok\n")


# (define, a long run that prints "sleeping" first, read back, the error)
SIGINT = {
    "python": ("kept_d = 7", "import time\nprint('sleeping')\ntime.sleep(60)", "print(kept_d)",
               ("KeyboardInterrupt", "")),
    "bash": ("kept_d=7", "echo sleeping\nsleep 60\necho not reached", "echo $kept_d",
             ("KeyboardInterrupt", "interrupted")),
    "go": ("kept_d := 7", 'import (\n\t"fmt"\n\t"time"\n)\nfmt.Println("sleeping")\n'
                          "time.Sleep(60 * time.Second)",
           'import "fmt"\nfmt.Println(kept_d)', ("KeyboardInterrupt", "interrupted")),
    # A busy loop (vm breakOnSigint) in JavaScript, an awaited promise in TypeScript.
    "javascript": ("var kept_d = 7;", "console.log('sleeping'); for (;;) {}",
                   "console.log(kept_d);",
                   ("Error", "Script execution was interrupted by `SIGINT`")),
    "typescript": ("var kept_d: number = 7;",
                   "new Promise<void>((r) => {\n"
                   "  setTimeout(() => console.log('sleeping'), 20);\n"
                   "  setTimeout(r, 60000);\n"
                   "});",
                   "console.log(kept_d);",
                   ("Interrupted", "Script execution was interrupted by `SIGINT`")),
    "r": ("kept_d <- 7", 'cat("sleeping\\n")\nSys.sleep(60)', 'cat(kept_d, "\\n", sep = "")',
          ("Interrupt", "interrupted")),
    "java": ("int kept_d = 7;", 'System.out.println("sleeping"); Thread.sleep(60000);',
             "System.out.println(kept_d);", ("Interrupted", "stopped")),
}


def interrupted(d: Driver, define: str, slow: str, read: str, error: tuple[str, str],
                printed: str = "sleeping\n", expect: str = "7\n"):
    """Defines a variable, interrupts a run once it printed, reads the
    variable back."""
    ok(d.run(define))
    r = d.run(slow, interrupt_on=printed, timeout=30)
    assert time.monotonic() - d.interrupted_at < INTERRUPT_GRACE, r
    assert r.end["status"] == "error", r
    assert [(e["name"], e["value"]) for e in r.of("error")] == [error], r
    assert r.stdout == printed, r
    assert d.alive()
    ok(d.run(read), stdout=expect)


@pytest.mark.parametrize("language", LANGUAGES)
def test_sigint_stops_the_run_and_keeps_state(pool, language):
    interrupted(pool(language), *SIGINT[language])


@pytest.mark.parametrize("language", ["javascript", "typescript"])
def test_js_sigint_as_the_script_ends(pool, language):
    """SIGINT that comes as a cell's script returns a promise (the vm module
    listens for it only while the script runs) still ends the run, as an
    interrupted script or an abandoned promise."""
    d = pool(language)
    for _ in range(20):
        r = d.run("console.log('sleeping');\nnew Promise((r) => setTimeout(r, 60000));",
                  interrupt_on="sleeping\n", timeout=20)
        assert time.monotonic() - d.interrupted_at < INTERRUPT_GRACE, r
        assert r.end["status"] == "error" and r.stdout == "sleeping\n", r
        assert [(e["name"], e["value"]) for e in r.of("error")] in (
            [("Error", "Script execution was interrupted by `SIGINT`")],
            [("Interrupted", "Script execution was interrupted by `SIGINT`")]), r
    ok(d.run(AFTER[language]), stdout="ok\n")


@pytest.mark.parametrize("language", LANGUAGES)
def test_sigint_between_runs_is_not_for_the_next(pool, language):
    """A SIGINT that comes while no run is in progress (a timeout that fired
    as the run ended) neither kills the driver nor stops the next run."""
    d = pool(language)
    ok(d.run(AFTER[language]), stdout="ok\n")
    d.interrupt()
    time.sleep(0.5)
    assert d.alive()
    ok(d.run(AFTER[language]), stdout="ok\n")


def test_java_sigint_while_a_snippet_compiles(pool):
    """SIGINT while jshell compiles the next snippet of a cell, when no code
    runs that JShell.stop() could stop, still stops that snippet once it
    runs; the snippets after it do not run."""
    block = "".join(f"    long v{i} = {i}L * {i};\n" for i in range(300))
    interrupted(pool("java"), "int kept_g = 7;",
                'System.out.println("sleeping");\n{\n' + block + '    Thread.sleep(60000);\n}\n'
                'System.out.println("not reached");',
                "System.out.println(kept_g);", ("Interrupted", "stopped"))


def test_bash_sigint_while_bash_expands_a_command(pool):
    """SIGINT that comes while bash itself works on a command (here a slow
    expansion) runs bash's trap only after that command, a long sleep."""
    interrupted(pool("bash"), "kept_e=7",
                'big=$(printf "%030000d" 0)\necho sleeping\nsleep 60 ${big//0/}', "echo $kept_e",
                ("KeyboardInterrupt", "interrupted"))


def test_bash_second_sigint_keeps_runs_in_step(pool):
    """A second SIGINT while the driver waits for the interrupted cell to end
    (a timeout, then an interrupt; here the cell traps the first) still
    waits for it, so the next run does not take that cell's status."""
    d = pool("bash")
    r = d.run("trap 'echo trapped' INT\necho sleeping\nsleep 60\nsleep 60\necho done",
              interrupt_on="sleeping\n", interrupts=2, timeout=30)
    assert [(e["name"], e["value"]) for e in r.of("error")] == [("KeyboardInterrupt", "interrupted")], r
    assert r.stdout.startswith("sleeping\ntrapped\n") and r.stdout.endswith("trapped\ndone\n"), r
    ok(d.run("sleep 1; echo slept"), stdout="slept\n")


def test_bash_cell_reads_no_commands(pool):
    """A cell's stdin is /dev/null: bash's own stdin carries the driver's
    commands, which a cell must not read."""
    ok(pool("bash").run('read -r line_f; echo "got:$line_f"'), stdout="got:\n")


# The name of the error a run that SIGINT stopped reports.
INTERRUPT_NAMES = {
    "python": {"KeyboardInterrupt"}, "bash": {"KeyboardInterrupt"}, "go": {"KeyboardInterrupt"},
    "javascript": {"Error", "Interrupted"}, "typescript": {"Error", "Interrupted"},
    "r": {"Interrupt"}, "java": {"Interrupted"},
}


@pytest.mark.parametrize("language", LANGUAGES)
def test_sigint_at_any_moment(pool, language):
    """SIGINT every few milliseconds, wherever it falls (while the driver
    waits for a run, runs it or writes its events), ends at most the run in
    progress: every run still ends, with its output or an interrupt error,
    and the driver and its state stay. (The text of a print that SIGINT cut
    may come with the next run's output: Java's stopped thread leaves it in
    System.out's buffer.)"""
    d = pool(language)
    define, read = STATE[language]
    ok(d.run(define.replace("counter_a", "kept_h")))
    stop = threading.Event()

    def storm():
        while not stop.wait(0.005):
            d.interrupt()

    t = threading.Thread(target=storm)
    t.start()
    try:
        for _ in range(30):
            r = d.run(AFTER[language], timeout=INTERRUPT_GRACE)
            assert all(part in ("", "o", "ok") for part in r.stdout.split("ok\n")), r
            if r.end["status"] == "ok":
                assert r.kinds() <= {"stdout"} and r.stdout.endswith("ok\n"), r
            else:
                assert r.end["status"] == "error", r
                assert r.kinds() <= {"stdout", "error"}, r
                assert [e["name"] for e in r.of("error")] in ([n] for n in INTERRUPT_NAMES[language]), r
    finally:
        stop.set()
        t.join()
    time.sleep(0.3)
    assert d.alive()
    ok(d.run(read.replace("counter_a", "kept_h")), stdout="42\n")
