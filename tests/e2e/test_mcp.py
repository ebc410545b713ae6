"""MCP (`/mcp`, and the `runtime mcp` stdio bridge) through the official
`mcp` SDK's client over both transports: Streamable HTTP against the server,
and stdio through `target/release/runtime mcp`. Each drives a real sandbox
from create to delete; the rest checks the refusals an agent sees."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from typing import Any, AsyncIterator

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client
from mcp.shared.exceptions import MCPError

from conftest import BINARY
from conftest import http as call

TOOLS = {
    "runtime_sandbox_create", "runtime_sandbox_list", "runtime_sandbox_manage", "runtime_sandbox_exec",
    "runtime_sandbox_process", "runtime_sandbox_files_read", "runtime_sandbox_files_write",
    "runtime_sandbox_files_list", "runtime_sandbox_files_manage", "runtime_sandbox_files_watch",
    "runtime_sandbox_interpreter_run", "runtime_sandbox_fork", "runtime_snapshot",
    "runtime_sandbox_previews", "runtime_sandbox_network", "runtime_image", "runtime_volume",
    "runtime_sandbox_metrics", "runtime_events_list", "runtime_account",
}


@contextlib.asynccontextmanager
async def over_http(server, key: str) -> AsyncIterator[tuple[ClientSession, Any]]:
    async with create_mcp_http_client(headers={"Authorization": f"Bearer {key}"}) as client:
        async with streamable_http_client(f"{server.url}/mcp", http_client=client) as (read, write):
            async with ClientSession(read, write) as session:
                yield session, await session.initialize()


@contextlib.asynccontextmanager
async def over_stdio(server, key: str, tmp_path) -> AsyncIterator[tuple[ClientSession, Any]]:
    # No saved login to fall back on: the bridge uses what the environment says.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path),
           "RUNTIME_API_URL": server.url, "RUNTIME_API_KEY": key}
    params = StdioServerParameters(command=str(BINARY), args=["mcp"], env=env)
    with (tmp_path / "bridge.log").open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                yield session, await session.initialize()


def mcp_error(error: BaseException) -> MCPError | None:
    """The MCPError raised, or inside the exception groups task groups raise."""
    if isinstance(error, MCPError):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = mcp_error(inner)
        if found is not None:
            return found
    return None


async def tool(session: ClientSession, name: str, args: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(isError, structuredContent) of one call; its text is the same JSON."""
    r = await session.call_tool(name, args)
    assert r.content[0].type == "text"
    assert json.loads(r.content[0].text) == r.structured_content
    return bool(r.is_error), r.structured_content


async def ok(session: ClientSession, name: str, args: dict[str, Any]) -> dict[str, Any]:
    failed, v = await tool(session, name, args)
    assert not failed, f"{name} {args}: {v}"
    return v


async def drive_a_sandbox(session: ClientSession, init: Any, label: str) -> None:
    """create, exec, write then read, list, delete: the session an agent has."""
    assert init.server_info.name == "runtime"
    assert "runtime_sandbox_create" in init.instructions
    listed = (await session.list_tools()).tools
    names = {t.name for t in listed}
    assert TOOLS <= names, TOOLS - names
    exec_tool = next(t for t in listed if t.name == "runtime_sandbox_exec")
    assert exec_tool.input_schema["required"] == ["id", "command"]
    assert exec_tool.annotations.read_only_hint is False

    key = f"mcp-{label}-{uuid.uuid4().hex[:12]}"
    made = await ok(session, "runtime_sandbox_create",
                    {"labels": {"via": label}, "idempotencyKey": key, "timeoutSeconds": 600})
    sid = made["id"]
    try:
        assert made["state"] == "running"
        # A lost reply resent with its key is the same sandbox, not a second one.
        again = await ok(session, "runtime_sandbox_create",
                         {"labels": {"via": label}, "idempotencyKey": key, "timeoutSeconds": 600})
        assert again["id"] == sid

        ran = await ok(session, "runtime_sandbox_exec",
                       {"id": sid, "command": "echo $((6*7)) $(cat /proc/sys/kernel/hostname)"})
        assert ran["exitCode"] == 0 and ran["stdout"].split()[0] == "42", ran
        ran = await ok(session, "runtime_sandbox_exec", {"id": sid, "command": ["sh", "-c", "echo oops >&2; exit 3"]})
        assert (ran["exitCode"], ran["stderr"]) == (3, "oops\n")

        token = uuid.uuid4().hex
        text = f"first\n{token}\nlast\n"
        wrote = await ok(session, "runtime_sandbox_files_write",
                         {"id": sid, "path": f"/workspace/{label}/note.txt", "content": text})
        assert wrote["size"] == len(text)
        # Written by the API, seen by a command in the VM.
        ran = await ok(session, "runtime_sandbox_exec", {"id": sid, "command": f"sha256sum {label}/note.txt"})
        assert ran["stdout"].split()[0] == wrote["sha256"]
        read = await ok(session, "runtime_sandbox_files_read",
                        {"id": sid, "path": f"/workspace/{label}/note.txt", "startLine": 2, "endLine": 2})
        assert (read["content"], read["totalLines"]) == (f"{token}\n", 3)
        files = await ok(session, "runtime_sandbox_files_list", {"id": sid, "path": label})
        assert [e["name"] for e in files["data"]] == ["note.txt"]

        # A background process, followed from a cursor until it ends.
        started = await ok(session, "runtime_sandbox_exec",
                           {"id": sid, "command": "for i in 1 2 3; do echo line$i; sleep 0.2; done; exit 5",
                            "background": True})
        pid, cursor, out = started["id"], 0, ""
        for _ in range(40):
            read = await ok(session, "runtime_sandbox_process",
                            {"id": sid, "action": "output", "processId": pid, "cursor": cursor, "waitMs": 2000})
            out += "".join(c["text"] for c in read["chunks"])
            cursor = read["nextCursor"]
            if read["process"]["state"] != "running" and not read["chunks"]:
                break
        assert out == "line1\nline2\nline3\n"
        assert read["process"]["exitCode"] == 5

        mine = await ok(session, "runtime_sandbox_list", {"labels": {"via": label}})
        assert [s["id"] for s in mine["data"]] == [sid]
    finally:
        gone = await ok(session, "runtime_sandbox_manage", {"id": sid, "action": "delete"})
    assert gone["id"] == sid
    failed, v = await tool(session, "runtime_sandbox_manage", {"id": sid, "action": "get"})
    assert failed and v["error"]["status"] == 404, v


def test_streamable_http_drives_a_sandbox(server):
    async def go():
        async with over_http(server, server.admin_key()) as (session, init):
            await drive_a_sandbox(session, init, "http")
    asyncio.run(go())


def test_stdio_bridge_drives_a_sandbox(server, tmp_path):
    key = server.create_key(name="mcp-stdio")

    async def go():
        async with over_stdio(server, key, tmp_path) as (session, init):
            await drive_a_sandbox(session, init, "stdio")
    asyncio.run(go())


def test_bad_arguments_and_read_only_keys_are_tool_errors(server, tmp_path):
    ro = server.create_key(read_only=True, name="mcp-ro")

    async def go():
        async with over_stdio(server, ro, tmp_path) as (session, _):
            failed, v = await tool(session, "runtime_sandbox_exec", {"id": 7, "comand": "ls"})
            assert failed
            assert v["error"]["code"] == "invalid_request"
            assert [i["field"] for i in v["error"]["details"]["issues"]] == ["comand", "command", "id"]
            # The API's own check: a read-only key changes nothing.
            failed, v = await tool(session, "runtime_sandbox_create", {})
            assert failed and (v["error"]["status"], v["error"]["code"]) == (403, "forbidden"), v
            assert v["error"]["requestId"].startswith("req_")
            me = await ok(session, "runtime_account", {"action": "get"})
            assert me, me
            with pytest.raises(MCPError) as unknown:
                await session.call_tool("runtime_teleport", {})
            assert unknown.value.error.code == -32602
            assert "runtime_teleport" in unknown.value.error.message
    asyncio.run(go())


def test_no_key_is_401_pointing_at_the_metadata(server, tmp_path):
    answer = call(server, "POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}},
                  key=None)
    assert answer.status == 401
    meta_url = f"{server.url}/.well-known/oauth-protected-resource"
    assert answer.headers["www-authenticate"] == f'Bearer resource_metadata="{meta_url}"'
    meta = call(server, "GET", "/.well-known/oauth-protected-resource", key=None)
    assert meta.status == 200
    assert meta.json()["resource"] == f"{server.url}/mcp"
    assert meta.json()["bearer_methods_supported"] == ["header"]

    async def go():
        with pytest.raises(BaseException) as refused:
            async with over_stdio(server, "rtcloud_not_a_key", tmp_path):
                pass
        error = mcp_error(refused.value)
        assert error is not None, refused.value
        assert "Missing or invalid API key" in error.error.message, error.error
        assert "HTTP 401" in error.error.message
    asyncio.run(go())
