"""LangChain agents with the client's four sandbox tools, driven by a
scripted chat model (examples/scripted_model.py) that makes real tool calls."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from scripted_model import PROGRAM, PROGRAM_PATH, ScriptedChatModel
from withruntime import AsyncRuntime, NotFoundError
from withruntime.tools import sandbox_tools

from conftest import REPO

TASK = {"messages": [{"role": "user", "content": "write hello.py, run it, list, read it back"}]}


def tool_results(messages) -> dict[str, str]:
    return {m.name: m.content if isinstance(m.content, str) else json.dumps(m.content)
            for m in messages if isinstance(m, ToolMessage)}


def check_run(messages) -> None:
    calls = [c["name"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls == ["runtime_write_file", "runtime_exec", "runtime_list_files", "runtime_read_file"]
    results = tool_results(messages)
    assert results["runtime_write_file"] == f"Wrote {len(PROGRAM)} bytes to /workspace/{PROGRAM_PATH}"
    ran = json.loads(results["runtime_exec"])
    assert ran == {"exit_code": 0, "stdout": "42\n", "stderr": "", "timed_out": False}
    assert f"/workspace/{PROGRAM_PATH}" in results["runtime_list_files"]
    assert "error" not in results["runtime_list_files"]
    assert results["runtime_read_file"] == PROGRAM
    assert messages[-1].content.endswith("it printed 42.")


def test_sync_agent(server, sbx):
    agent = create_agent(ScriptedChatModel(), tools=[tool(f) for f in sandbox_tools(sbx)])
    result = agent.invoke(TASK)
    check_run(result["messages"])
    # The agent's work is really in the sandbox.
    assert sbx.files.read(f"/workspace/{PROGRAM_PATH}") == PROGRAM.encode()


def test_async_agent(server):
    async def scenario():
        async with AsyncRuntime() as rt:
            async with await rt.sandboxes.create() as asbx:
                agent = create_agent(ScriptedChatModel(), tools=[tool(f) for f in sandbox_tools(asbx)])
                result = await agent.ainvoke(TASK)
                check_run(result["messages"])
                assert (await asbx.exec(f"python3 {PROGRAM_PATH}")).stdout == "42\n"

    asyncio.run(scenario())


def test_tools_report_failures(server, sbx):
    tools = {f.__name__: f for f in sandbox_tools(sbx)}
    failed = tools["runtime_exec"]("echo bad >&2; exit 2")
    assert failed["exit_code"] == 2 and failed["stderr"] == "bad\n"
    assert tools["runtime_read_file"]("no/such/file.txt") == "No such file: /workspace/no/such/file.txt"
    assert tools["runtime_exec"]("sleep 10", timeout_seconds=1)["timed_out"] is True


def test_example_runs_with_the_scripted_model(server, runtime):
    env = {k: v for k, v in os.environ.items() if k != "RUNTIME_EXAMPLE_MODEL"}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "langchain_agent.py")], env=env,
                          capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "model: scripted" in out
    assert "result runtime_exec:" in out and '"stdout": "42\\n"' in out
    assert re.search(r"^answer: I wrote hello\.py .* it printed 42\.$", out, re.M), out
    sandbox_id = re.search(r"^sandbox: (\S+)$", out, re.M).group(1)
    with pytest.raises(NotFoundError):
        runtime.sandboxes.get(sandbox_id)
