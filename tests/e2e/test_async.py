"""The asyncio client: create, exec, files, `async with`."""
from __future__ import annotations

import asyncio

import pytest
from withruntime import AsyncRuntime, NotFoundError


def test_async_create_exec_and_context(server):
    async def scenario():
        async with AsyncRuntime() as rt:
            sbx = await rt.sandboxes.create(labels={"suite": "e2e-async"})
            async with sbx:
                assert sbx.state == "running"
                result = await sbx.exec("echo $((6 * 7))")
                assert result.exit_code == 0 and result.stdout == "42\n"
                await sbx.files.write("/workspace/async.txt", "from asyncio")
                assert await sbx.files.read("/workspace/async.txt") == b"from asyncio"
                results = await asyncio.gather(*(sbx.exec(f"sleep 1; echo {i}") for i in range(3)))
                assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
                chunks: list[str] = []
                streamed = await sbx.exec("echo one; echo two", on_stdout=chunks.append)
                assert "".join(chunks) == "one\ntwo\n" == streamed.stdout
                got = await rt.sandboxes.get(sbx.id)
                assert got.id == sbx.id
                sandbox_id = sbx.id
            with pytest.raises(NotFoundError):
                await rt.sandboxes.get(sandbox_id)

    asyncio.run(scenario())
