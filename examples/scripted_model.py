"""A chat model that needs no key: it plays a fixed plan of real tool calls.

It stands in for an LLM in the example (when no model is configured) and in
the end-to-end tests, so the agent loop, the tool schemas LangChain builds from
``withruntime.tools.sandbox_tools`` and the sandbox calls behind them are all
exercised for real. The plan: write a program, run it, list the directory,
read the program back, then answer with what the run printed.

Each turn is chosen from the conversation so far (the number of AI messages
in it), so one model instance serves any number of runs, sync or async.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

PROGRAM_PATH = "hello.py"
PROGRAM = "print(6 * 7)\n"

# (tool name, arguments) per turn; the turn after the last is the answer.
PLAN: list[tuple[str, dict[str, Any]]] = [
    ("runtime_write_file", {"path": PROGRAM_PATH, "content": PROGRAM}),
    ("runtime_exec", {"command": f"python3 {PROGRAM_PATH}"}),
    ("runtime_list_files", {"path": "."}),
    ("runtime_read_file", {"path": PROGRAM_PATH}),
]


def _tool_output(messages: Sequence[BaseMessage], name: str) -> Optional[str]:
    """The last result of tool ``name`` in the conversation."""
    for message in reversed(messages):
        if isinstance(message, ToolMessage) and message.name == name:
            return message.content if isinstance(message.content, str) else json.dumps(message.content)
    return None


def final_answer(messages: Sequence[BaseMessage]) -> str:
    """The answer, built only from what the tools returned."""
    ran = _tool_output(messages, "runtime_exec") or ""
    printed = ""
    try:
        printed = str(json.loads(ran).get("stdout", "")).strip()
    except (ValueError, AttributeError):
        # LangChain may render a dict result as its repr rather than JSON.
        marker = "'stdout': '"
        if marker in ran:
            printed = ran.split(marker, 1)[1].split("'", 1)[0].replace("\\n", "\n").strip()
    source = (_tool_output(messages, "runtime_read_file") or "").strip()
    return f"I wrote {PROGRAM_PATH} ({source!r}) and ran it; it printed {printed or 'nothing'}."


class ScriptedChatModel(BaseChatModel):
    """Returns the planned tool calls turn by turn, then a final answer."""

    plan: list[tuple[str, dict[str, Any]]] = PLAN

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> "ScriptedChatModel":
        # The plan names the tools itself; the schemas are still built by
        # LangChain (create_agent turns each function into a tool first).
        return self

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        turn = sum(1 for m in messages if isinstance(m, AIMessage))
        if turn < len(self.plan):
            name, args = self.plan[turn]
            message = AIMessage(content="", tool_calls=[{"name": name, "args": dict(args), "id": f"call_{turn}",
                                                         "type": "tool_call"}])
        else:
            message = AIMessage(content=final_answer(messages))
        return ChatResult(generations=[ChatGeneration(message=message)])
