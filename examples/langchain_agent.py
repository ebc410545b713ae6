"""A LangChain agent with the four sandbox tools, against a `runtime` server.

    export RUNTIME_API_URL=http://127.0.0.1:8080
    export RUNTIME_API_KEY=$(cat <data-dir>/admin.key)
    python examples/langchain_agent.py

With RUNTIME_EXAMPLE_MODEL set (for example "openai:gpt-4o-mini", with that
provider's package installed and its key in the environment) a real model
drives the agent; without it a scripted model (examples/scripted_model.py)
plays the same task as fixed tool calls, so the example runs with no key.
The sandbox is created for the run and deleted at the end.
"""
from __future__ import annotations

import os
import sys

from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from withruntime import Sandbox
from withruntime.tools import sandbox_tools

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scripted_model import ScriptedChatModel  # noqa: E402

TASK = ("Write a Python program hello.py that prints 6 * 7, run it with python3, "
        "list the files in the working directory, read hello.py back, and tell me what it printed.")


def make_model():
    name = os.environ.get("RUNTIME_EXAMPLE_MODEL")
    if not name:
        return ScriptedChatModel(), "scripted"
    from langchain.chat_models import init_chat_model
    return init_chat_model(name), name


def main() -> int:
    model, label = make_model()
    print(f"model: {label}")
    with Sandbox.create() as sbx:
        print(f"sandbox: {sbx.id}")
        tools = [tool(f) for f in sandbox_tools(sbx)]
        agent = create_agent(model, tools=tools,
                             system_prompt="You work in a Linux sandbox through the tools you are given.")
        result = agent.invoke({"messages": [{"role": "user", "content": TASK}]})
        for message in result["messages"]:
            if isinstance(message, AIMessage):
                for call in message.tool_calls:
                    print(f"call {call['name']} {call['args']}")
            elif isinstance(message, ToolMessage):
                print(f"result {message.name}: {str(message.content)[:300]}")
        answer = result["messages"][-1]
        print(f"answer: {answer.content}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
