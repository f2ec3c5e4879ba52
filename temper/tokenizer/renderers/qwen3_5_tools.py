"""Qwen3.5's tool calls: the XML call blocks a reply writes, and the tools system prompt.

A call is written, and sampled, as

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

one `<parameter>` per argument in the order given. A VALUE that is an object or a list is its
JSON text; any other value is its Python `str` (`True`, `None`, `1.5`, a string as is), which
is what Qwen3.5's chat template writes (`|string` for scalars). Parsing reads a VALUE as JSON
where it parses and as the string otherwise. Several calls in one reply are separated by a
newline.

In messages, a call is written the way HF chat templates take it:
`{"type": "function", "function": {"name": NAME, "arguments": {...}}}` (arguments may also be
a JSON string holding an object, as the OpenAI API sends them; "type" and "id" may be left
out). Parsed calls come back in that form with arguments as an object.

A call block that does not parse is kept as an `UnparsedToolCall` (its text and the reason),
never dropped: a policy that writes a broken call can be told so. A JSON call object
(`{"name": ..., "arguments": {...}}`, Qwen3's format) inside `<tool_call>` also parses, as the
tinker-cookbook's Qwen3.5 parser accepts it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
UNTERMINATED = "unterminated tool call: '<tool_call>' without a matching '</tool_call>'"
MAX_UNPARSED_CHARS = 16384
"""Longest text of an unterminated call block kept in its UnparsedToolCall."""

_CALL_BLOCK = re.compile(
    r"^\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>\s*(?P<body>.*?)\s*</function>\s*"
    r"</tool_call>\s*$",
    re.DOTALL,
)
_PARAMETER = re.compile(r"<parameter=(?P<name>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>", re.DOTALL)

TOOLS_PREAMBLE = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tools}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\n"
    "This is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> "
    "block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE "
    "the function call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your "
    "current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
"""The tools section of Qwen3.5's system prompt (its chat template's text), one JSON tool
specification per line in place of {tools}."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]
    """Argument name -> JSON value, in the order the call gives them."""
    id: str | None = None

    def to_message(self) -> dict[str, Any]:
        """The call as a message's `tool_calls` entry."""
        entry: dict[str, Any] = {"type": "function"}
        if self.id is not None:
            entry["id"] = self.id
        entry["function"] = {"name": self.name, "arguments": dict(self.arguments)}
        return entry


@dataclass(frozen=True)
class UnparsedToolCall:
    text: str
    """The call block as sampled."""
    error: str


def tool_calls_of(message: Mapping[str, Any], *, index: int) -> list[ToolCall]:
    """The `tool_calls` of message `index` (none when absent, null or empty), or a
    ValueError naming the message, the call and what a call looks like."""
    calls = message.get("tool_calls")
    if not calls:
        return []
    if message["role"] != "assistant":
        raise ValueError(f"message {index}: only assistant messages have tool_calls")
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise ValueError(f"message {index}: tool_calls must be a list of calls")
    return [
        _tool_call(call, where=f"message {index}: tool call {i}") for i, call in enumerate(calls)
    ]


def _tool_call(call: Any, *, where: str) -> ToolCall:
    expected = '{"type": "function", "function": {"name": "...", "arguments": {...}}}'
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {expected}, got {call!r}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: arguments are not valid JSON ({error})") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where}: arguments must be an object, got {arguments!r}")
    call_id = call.get("id")
    return ToolCall(
        name=function["name"],
        arguments=dict(arguments),
        id=call_id if isinstance(call_id, str) else None,
    )


def format_tool_call(call: ToolCall) -> str:
    """One call as Qwen3.5 writes it (see the module docstring)."""
    lines = [f"{TOOL_CALL_OPEN}\n<function={call.name}>"]
    for name, value in call.arguments.items():
        text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        lines.append(f"<parameter={name}>\n{text}\n</parameter>")
    lines.append(f"</function>\n{TOOL_CALL_CLOSE}")
    return "\n".join(lines)


def tools_system_prompt(tools: Sequence[Mapping[str, Any]], *, system_prompt: str = "") -> str:
    """The system message text offering `tools` (JSON tool specifications, written one per
    line as given), followed by `system_prompt` after a blank line; no tools: the prompt."""
    if not tools:
        return system_prompt
    section = TOOLS_PREAMBLE.replace("{tools}", "\n".join(json.dumps(tool) for tool in tools))
    return f"{section}\n\n{system_prompt}" if system_prompt else section


def parse_tool_calls(blocks: Sequence[str]) -> tuple[list[ToolCall], list[UnparsedToolCall]]:
    """The calls of sampled `<tool_call>...</tool_call>` blocks, and the blocks that do not
    parse. A block holding a JSON call object is read as that, else as the XML form; the
    JSON calls come first, then the XML ones, each in the order sampled."""
    json_calls: list[ToolCall] = []
    xml_calls: list[ToolCall] = []
    unparsed: list[UnparsedToolCall] = []
    for block in blocks:
        inner = block.removeprefix(TOOL_CALL_OPEN).removesuffix(TOOL_CALL_CLOSE)
        json_call = _json_call(inner)
        if isinstance(json_call, ToolCall):
            json_calls.append(json_call)
        elif "<function=" not in block:
            unparsed.append(UnparsedToolCall(block, json_call))
        else:
            xml_call = _xml_call(block)
            if isinstance(xml_call, ToolCall):
                xml_calls.append(xml_call)
            else:
                unparsed.append(xml_call)
    return json_calls + xml_calls, unparsed


def _json_call(inner: str) -> ToolCall | str:
    """The JSON call object in `inner`, or why there is none."""
    try:
        value = json.loads(inner.strip())
    except json.JSONDecodeError as error:
        return f"not a JSON call object: {error}"
    if not isinstance(value, dict):
        return "not a JSON call object"
    name, arguments, call_id = value.get("name"), value.get("arguments"), value.get("id")
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return "a JSON call needs a string 'name' and an object 'arguments'"
    return ToolCall(
        name=name, arguments=arguments, id=call_id if isinstance(call_id, str) else None
    )


def _xml_call(block: str) -> ToolCall | UnparsedToolCall:
    match = _CALL_BLOCK.match(block)
    if match is None:
        return UnparsedToolCall(block, "not a <function=...>...</function> call")
    name, body = match.group("name").strip(), match.group("body")
    if not name:
        return UnparsedToolCall(block, "the function has no name")
    arguments: dict[str, Any] = {}
    position = 0
    for parameter in _PARAMETER.finditer(body):
        if body[position : parameter.start()].strip():
            return UnparsedToolCall(block, "text between the <parameter> blocks")
        argument = parameter.group("name").strip()
        if not argument:
            return UnparsedToolCall(block, "a parameter has no name")
        text = parameter.group("value").strip("\n")
        try:
            arguments[argument] = json.loads(text)
        except json.JSONDecodeError:
            arguments[argument] = text
        position = parameter.end()
    if body[position:].strip():
        return UnparsedToolCall(block, "text after the last <parameter> block")
    return ToolCall(name=name, arguments=arguments)
