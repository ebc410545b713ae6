"""The stateful interpreter (contract §8) through the official client: state
kept across runs per language, errors and timeouts that keep the context,
rich results (text/plain, image/png, a DataFrame as text/html and the table
type), streaming, contexts (two of one language, restart, delete), in the
seven languages. One sandbox shared by the module."""
from __future__ import annotations

import base64
import threading
import time

import pytest
from withruntime import NotFoundError

from conftest import http


def test_python_state_value_and_error(sbx):
    first = sbx.interpreter.run("x = 41\ndef f(a):\n    return a * 2")
    assert first["status"] == "ok", first
    assert first["contextId"] == "python" and first["language"] == "python"
    assert first["results"] == [] and first["error"] is None
    value = sbx.interpreter.run("f(x + 1) // 2")
    assert value["status"] == "ok", value
    assert value["results"][0]["data"]["text/plain"] == "42"
    assert value["results"][0]["main"] is True
    assert value["executionCount"] == first["executionCount"] + 1
    two = sbx.interpreter.run("1+1")
    assert two["results"][0]["data"]["text/plain"] == "2"
    err = sbx.interpreter.run("print('before')\nimport sys; print('warn', file=sys.stderr)\n1/0")
    assert err["status"] == "error"
    assert err["stdout"] == "before\n" and err["stderr"] == "warn\n"
    assert err["error"]["name"] == "ZeroDivisionError"
    assert "division by zero" in err["error"]["value"]
    assert "ZeroDivisionError" in err["error"]["traceback"]
    after = sbx.interpreter.run("x")
    assert after["status"] == "ok" and after["results"][0]["data"]["text/plain"] == "41"


def test_python_timeout_keeps_state(sbx):
    sbx.interpreter.run("kept = 'yes'")
    started = time.monotonic()
    slow = sbx.interpreter.run("import time\nprint('going')\ntime.sleep(60)", timeout_ms=3000)
    assert time.monotonic() - started < 40
    assert slow["status"] == "timeout", slow
    assert "going" in slow["stdout"]
    again = sbx.interpreter.run("kept")
    assert again["status"] == "ok" and again["results"][0]["data"]["text/plain"] == "'yes'"
    assert again["contextStarted"] is False


@pytest.mark.timeout(600)
def test_python_matplotlib_png(sbx):
    run = sbx.interpreter.run(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.title('t')\nplt.show()",
        timeout_ms=240_000)
    assert run["status"] == "ok", (run["error"], run["stdout"][-2000:], run["stderr"][-2000:])
    pngs = [r for r in run["results"] if "image/png" in r["data"]]
    assert len(pngs) == 1, run["results"]
    assert base64.b64decode(pngs[0]["data"]["image/png"]).startswith(b"\x89PNG\r\n\x1a\n")
    # Figures are closed after being sent: the next run shows none.
    nxt = sbx.interpreter.run("len(plt.get_fignums())")
    assert nxt["results"][0]["data"]["text/plain"] == "0"


@pytest.mark.timeout(600)
def test_python_dataframe_html_and_table(sbx):
    run = sbx.interpreter.run(
        "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})", timeout_ms=240_000)
    assert run["status"] == "ok", run
    data = run["results"][-1]["data"]
    assert "<table" in data["text/html"]
    table = data["application/vnd.runtime.table+json"]
    assert table["columns"] == ["a", "b"]
    assert table["rows"] == [[1, "x"], [2, "y"]]
    assert table["totalRows"] == 2 and table["truncated"] is False


def test_streaming_delivers_output_while_running(sbx):
    seen: list[tuple[float, str]] = []
    started = time.monotonic()
    run = sbx.interpreter.run(
        "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(1.5)\n'done'",
        on_stdout=lambda text: seen.append((time.monotonic() - started, text)))
    assert run["status"] == "ok", run
    assert run["results"][0]["data"]["text/plain"] == "'done'"
    text = "".join(t for _, t in seen)
    assert text == run["stdout"] == "tick 0\ntick 1\ntick 2\n"
    # The first tick arrived well before the run ended.
    assert seen[0][0] < run["durationMs"] / 1000 - 1.5, seen


def test_streaming_error_and_result_callbacks(sbx):
    errors, results = [], []
    run = sbx.interpreter.run("raise ValueError('boom')", on_error=errors.append, on_result=results.append)
    assert run["status"] == "error"
    assert errors and errors[0]["name"] == "ValueError" and errors[0]["value"] == "boom"
    run = sbx.interpreter.run("7 * 6", on_result=results.append)
    assert results[-1]["data"]["text/plain"] == "42" and results[-1]["refs"] == []


def test_two_contexts_restart_and_delete(sbx):
    a = sbx.interpreter.contexts.create(language="python")
    b = sbx.interpreter.contexts.create(id="second", language="python")
    assert b["id"] == "second" and a["id"] != "second"
    sbx.interpreter.run("v = 'a'", context=a["id"])
    sbx.interpreter.run("v = 'b'", context="second")
    assert sbx.interpreter.run("v", context=a["id"])["results"][0]["data"]["text/plain"] == "'a'"
    assert sbx.interpreter.run("v", context="second")["results"][0]["data"]["text/plain"] == "'b'"
    ids = {c["id"] for c in sbx.interpreter.contexts.list()}
    assert {a["id"], "second"} <= ids
    restarted = sbx.interpreter.contexts.restart("second")
    assert restarted["executionCount"] == 0
    gone = sbx.interpreter.run("v", context="second")
    assert gone["status"] == "error" and gone["error"]["name"] == "NameError"
    assert gone["contextStarted"] is True and gone["executionCount"] == 1
    assert sbx.interpreter.contexts.remove("second") is True
    assert sbx.interpreter.contexts.remove("second") is False
    with pytest.raises(NotFoundError):
        sbx.interpreter.run("1", context="second")


def test_lost_context_starts_again(sbx):
    ctx = sbx.interpreter.contexts.create(language="python")
    sbx.interpreter.run("y = 1", context=ctx["id"])
    lost = sbx.interpreter.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", context=ctx["id"])
    assert lost["status"] == "lost", lost
    fresh = sbx.interpreter.run("'y' in dir()", context=ctx["id"])
    assert fresh["status"] == "ok" and fresh["contextStarted"] is True
    assert fresh["results"][0]["data"]["text/plain"] == "False"


def test_bash_state_error_timeout(sbx):
    run = sbx.interpreter.run("NAME=world; greet() { echo \"hello $1\"; }; cd /tmp", language="bash")
    assert run["status"] == "ok", run
    run = sbx.interpreter.run("greet $NAME; pwd", language="bash")
    assert run["stdout"] == "hello world\n/tmp\n", run
    err = sbx.interpreter.run("ls /no/such/dir", language="bash")
    assert err["status"] == "error" and "No such file" in err["stderr"]
    assert err["error"]["name"] == "ExitStatus"
    slow = sbx.interpreter.run("echo start; sleep 60; echo never", language="bash", timeout_ms=3000)
    assert slow["status"] == "timeout" and "never" not in slow["stdout"], slow
    assert sbx.interpreter.run("echo $NAME", language="bash")["stdout"] == "world\n"


def test_javascript_state_error_timeout(sbx):
    run = sbx.interpreter.run("let n = 20; const twice = (a) => a * 2; console.log('hi')",
                              language="javascript")
    assert run["status"] == "ok", run
    assert run["stdout"] == "hi\n"
    value = sbx.interpreter.run("twice(n) + 2", language="javascript")
    assert value["results"][0]["data"]["text/plain"] == "42"
    err = sbx.interpreter.run("null.x", language="javascript")
    assert err["status"] == "error" and err["error"]["name"] == "TypeError"
    slow = sbx.interpreter.run("while (true) {}", language="javascript", timeout_ms=3000)
    assert slow["status"] == "timeout", slow
    awaited = sbx.interpreter.run("new Promise((r) => setTimeout(() => r(n + 1), 50))", language="javascript")
    assert awaited["results"][0]["data"]["text/plain"] == "21"


# Per language: a cell that defines (and prints), one that uses the
# definitions (its value), an error (the context keeps its state), and a
# timeout that keeps the state too. Go builds the program at every run, which
# counts toward timeoutMs, so its timeout is longer.
LANGUAGES = {
    "typescript": dict(
        define="let n: number = 20;\nconst twice = (a: number): number => a * 2;\nconsole.log('hi')",
        use="twice(n) + 2", value="42",
        error="(null as any).missing", error_name="TypeError",
        slow="console.log('start'); while (true) {}", timeout_ms=3000),
    "r": dict(
        define="n <- 20\ntwice <- function(a) a * 2\ncat('hi\\n')",
        use="twice(n) + 2", value="[1] 42",
        error="stop('boom')", error_name="simpleError",
        slow="cat('start\\n'); Sys.sleep(120)", timeout_ms=3000),
    "java": dict(
        define="int n = 20;\nint twice(int a) { return a * 2; }\nSystem.out.println(\"hi\");",
        use="twice(n) + 2", value="42",
        error="Object o = null;\no.toString()", error_name="java.lang.NullPointerException",
        slow="System.out.println(\"start\");\nwhile (true) {}", timeout_ms=5000),
    "go": dict(
        define='import "fmt"\nn := 20\nfunc twice(a int) int {\n\treturn a * 2\n}\nfmt.Println("hi")',
        use="twice(n) + 2", value="42",
        error="var s []int\nfmt.Println(s[n])", error_name="Panic",
        slow='fmt.Println("start")\nfor {\n}', timeout_ms=30_000),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("language", list(LANGUAGES))
def test_language_state_error_timeout(sbx, language):
    case = LANGUAGES[language]
    first = sbx.interpreter.run(case["define"], language=language, timeout_ms=120_000)
    assert first["status"] == "ok", first
    assert first["contextId"] == language and first["language"] == language
    assert first["stdout"] == "hi\n", first
    used = sbx.interpreter.run(case["use"], language=language, timeout_ms=120_000)
    assert used["status"] == "ok", used
    assert [r["data"]["text/plain"] for r in used["results"] if r["main"]] == [case["value"]], used
    assert used["executionCount"] == first["executionCount"] + 1
    err = sbx.interpreter.run(case["error"], language=language, timeout_ms=120_000)
    assert err["status"] == "error", err
    assert err["error"]["name"] == case["error_name"], err["error"]
    again = sbx.interpreter.run(case["use"], language=language, timeout_ms=120_000)
    assert again["status"] == "ok" and again["results"][0]["data"]["text/plain"] == case["value"], again
    # The cell's own output proves it was running when the timeout struck
    # (Go's build counts toward timeoutMs too).
    slow = sbx.interpreter.run(case["slow"], language=language, timeout_ms=case["timeout_ms"])
    assert slow["status"] == "timeout", slow
    assert "start" in slow["stdout"], slow
    kept = sbx.interpreter.run(case["use"], language=language, timeout_ms=120_000)
    assert kept["status"] == "ok" and kept["contextStarted"] is False, kept
    assert kept["results"][0]["data"]["text/plain"] == case["value"], kept


def test_go_compile_error_names_the_cell_line(sbx):
    run = sbx.interpreter.run("x := 1\ny := missing + x", language="go", timeout_ms=120_000)
    assert run["status"] == "error", run
    assert run["error"]["name"] == "CompileError"
    assert "undefined: missing" in run["error"]["value"]
    assert "cell-" in run["error"]["traceback"] and ".go:2:" in run["error"]["traceback"], run["error"]


def test_r_streams_and_two_contexts_restart(sbx):
    seen: list[tuple[float, str]] = []
    started = time.monotonic()
    run = sbx.interpreter.run(
        "for (i in 1:3) { cat('tick', i, '\\n'); Sys.sleep(1.5) }\n'done'", language="r",
        on_stdout=lambda text: seen.append((time.monotonic() - started, text)), timeout_ms=120_000)
    assert run["status"] == "ok", run
    assert run["results"][0]["data"]["text/plain"] == '[1] "done"'
    assert "".join(t for _, t in seen) == run["stdout"] == "tick 1 \ntick 2 \ntick 3 \n"
    assert seen[0][0] < run["durationMs"] / 1000 - 1.5, seen
    a = sbx.interpreter.contexts.create(language="r")
    b = sbx.interpreter.contexts.create(language="r")
    sbx.interpreter.run("v <- 'a'", context=a["id"], timeout_ms=120_000)
    sbx.interpreter.run("v <- 'b'", context=b["id"], timeout_ms=120_000)
    assert sbx.interpreter.run("v", context=a["id"])["results"][0]["data"]["text/plain"] == '[1] "a"'
    assert sbx.interpreter.run("v", context=b["id"])["results"][0]["data"]["text/plain"] == '[1] "b"'
    sbx.interpreter.contexts.restart(b["id"])
    gone = sbx.interpreter.run("v", context=b["id"], timeout_ms=120_000)
    assert gone["status"] == "error" and "not found" in gone["error"]["value"], gone
    assert gone["contextStarted"] is True
    assert sbx.interpreter.contexts.remove(a["id"]) is True
    assert sbx.interpreter.contexts.remove(b["id"]) is True


def test_typescript_imports_persist_and_syntax_errors(sbx):
    run = sbx.interpreter.run("import * as path from 'path';\ntype T = { a: number };\nconst t: T = { a: 1 };",
                              language="typescript", timeout_ms=120_000)
    assert run["status"] == "ok", run
    used = sbx.interpreter.run("path.basename('/x/y.txt') + t.a", language="typescript")
    assert used["results"][0]["data"]["text/plain"] == "'y.txt1'", used
    bad = sbx.interpreter.run("let z: number = ;", language="typescript")
    assert bad["status"] == "error" and bad["error"]["name"] == "TSError", bad


@pytest.mark.timeout(400)
def test_long_silent_run_answers_late(server, sbx):
    """Past 90 s without an answer the server sends 200 with the late-answer
    header at once and the execution's JSON when the cell ends."""
    answer = http(server, "POST", f"/v1/sandboxes/{sbx.id}/interpreter:run",
                  {"code": "sleep 95; echo done", "language": "bash", "timeoutMs": 200_000}, timeout=300)
    assert answer.status == 200, answer
    assert answer.headers.get("runtime-late-answer") == "true", answer.headers
    run = answer.json()
    assert run["status"] == "ok" and run["stdout"] == "done\n", run
    # It really ran the 95 s: the guest measures it, and an emulated guest's
    # clock may run a few milliseconds off the sleep it timed (seen: 94998).
    assert run["durationMs"] >= 94_000, run


def test_validation_names_fields(server, sbx):
    answer = http(server, "POST", f"/v1/sandboxes/{sbx.id}/interpreter:run",
                  {"language": "cobol", "timeoutMs": -1, "extra": 1})
    assert answer.status == 400, answer
    fields = {i["field"] for i in answer.json()["error"]["details"]["issues"]}
    assert fields == {"code", "language", "timeoutMs", "extra"}
