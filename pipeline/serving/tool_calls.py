"""Tool calls for DeepSeek-V3 / V3.1 / R1-0528, pure: ``tools`` and ``tool_choice`` validated, the tools
written into the prompt, the grammar that forces a call, and the model's tool-call text parsed into
OpenAI ``tool_calls`` (streamed too).

DeepSeek writes a call with its tool tokens, in one of two dialects (:data:`V3`, :data:`V31`), as vLLM's
``deepseek_v3`` and ``deepseek_v31`` tool parsers read them::

    V3 (V3, R1, R1-0528):  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                           ```json
                           ARGS
                           ```<｜tool▁call▁end｜>  (more calls after a newline)  <｜tool▁calls▁end｜>
    V3.1:                  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
                           (more calls chained directly)  <｜tool▁calls▁end｜>

The dialect is the chat template's: a template that writes ``\\`\\`\\`json`` around the arguments is V3, one that
has the tool tokens without it V3.1; the embedded model's template has no tool branches, so its chats
with tools or tool messages are rendered with :data:`pipeline.text.chat_templates.DEEPSEEK_V3_TOOLS`
(DeepSeek-V3's own template: its assistant ``tool_calls`` and ``tool`` message branches). The tools'
descriptions go into the system prompt in V3.1's words (V3's template has no place for them), as a
trusted message: the tool tokens in it are the template's, while message content stays text
(pipeline.text.tokenizer.Tokenizer.encode_chat).

``tool_choice``: ``none`` (the tools are not offered, nothing is parsed), ``auto`` (offered; calls the
model writes are parsed), ``required`` (one or more calls, of any of the tools: ``parallel_tool_calls``
false allows one) or ``{"type": "function", "function": {"name": ...}}`` (one call of that tool). The
last two are forced by constrained decoding (:func:`call_grammar`): the output is a well-formed call whose
arguments follow the tool's ``parameters`` schema, compact JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from pipeline.serving.api_errors import invalid
from pipeline.serving.reasoning import held_back

V3, V31 = "v3", "v3.1"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")   # OpenAI's rule for a function name
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools as the response needs them: the tool names, the choice (``auto``, ``required``
    or the named tool's name), the dialect."""

    names: tuple[str, ...]
    choice: str
    dialect: str = V3
    named: bool = False


def dialect_of(template: Optional[str]) -> Optional[str]:
    """The tool-call dialect a chat template writes; None when it has no tool branches."""
    if not template or "tool▁call▁begin" not in template:
        return None
    return V3 if "```json" in template else V31


# ----- validation ----------------------------------------------------------------------------------------

def parse_tools(body: Mapping[str, Any], tokenizer) -> tuple[list[dict], Optional[str]]:
    """(the validated ``tools``, the choice: ``none`` / ``auto`` / ``required`` / a tool's name), or a
    400 naming ``tools`` or ``tool_choice``. Each tool's ``parameters`` must compile as a JSON schema."""
    from pipeline.serving.structured_outputs import compile_or_400, json_schema_grammar

    tools, choice = body.get("tools"), body.get("tool_choice")
    par = body.get("parallel_tool_calls")
    if par is not None and not isinstance(par, bool):
        raise invalid(f"parallel_tool_calls must be a boolean, got {par!r}", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return [], None
    if not isinstance(tools, list) or not tools:
        raise invalid(f"tools must be a non-empty list of tools, got {tools!r}", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise invalid(f"{where} must be {{'type': 'function', 'function': {{...}}}}, got {t!r}", "tools")
        f = t["function"]
        unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise invalid(f"{where}.function: unrecognized key(s) {', '.join(unknown)}", "tools")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid(f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r}", "tools")
        if name in names:
            raise invalid(f"{where}.function.name {name!r} is given twice", "tools")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise invalid(f"{where}.function.description must be a string", "tools")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema object, got {params!r}", "tools")
        compile_or_400(tokenizer, json_schema_grammar(params), f"{where}.function.parameters", "tools")
        out.append({"name": name, "description": f.get("description") or "", "parameters": params})
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise invalid(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {choice!r}",
                          "tool_choice")
        return out, choice
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise invalid("tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}, got "
                      f"{choice!r}", "tool_choice")
    name = choice["function"]["name"]
    if name not in names:
        raise invalid(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return out, name


def check_messages_tools(messages: list[dict]) -> None:
    """An assistant message's ``tool_calls`` (the only non-text content a chat takes): each a function
    call with a name and its arguments as a JSON text (a 400 naming ``messages`` otherwise)."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list) or not calls:
            raise invalid(f"messages[{i}].tool_calls must be a non-empty list", "messages")
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
                raise invalid(f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': "
                              "str, 'arguments': str}}}}", "messages")


# ----- the prompt ----------------------------------------------------------------------------------------

def call_text(name: str, arguments: str, dialect: str) -> str:
    """One call as the model writes it (between the calls' begin and end tokens)."""
    if dialect == V3:
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def tools_prompt(tools: list[dict], dialect: str) -> str:
    """The system prompt's tools section (DeepSeek-V3.1's wording, the dialect's call format)."""
    parts = ["## Tools", "You have access to the following tools:"]
    for t in tools:
        parts.append(f"### {t['name']}\nDescription: {t['description']}\n\n"
                     f"Parameters: {json.dumps(t['parameters'], ensure_ascii=False)}")
    example = CALLS_BEGIN + call_text("tool_call_name", "tool_call_arguments", dialect) + "{{additional_tool_calls}}" \
        + CALLS_END
    parts.append("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n" + example + "\n\nWhere:\n"
                 "- `tool_call_name` must be an exact match to one of the available tools\n"
                 "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                 "- For multiple tool calls, chain them " + ("with a newline" if dialect == V3 else
                                                              "directly without separators or spaces"))
    return "\n\n".join(parts)


def with_tools_prompt(messages: list[dict], tools: list[dict], dialect: str) -> list[dict]:
    """``messages`` with the tools section as a trusted system message after the leading system ones."""
    k = 0
    while k < len(messages) and messages[k]["role"] == "system":
        k += 1
    return messages[:k] + [{"role": "system", "content": tools_prompt(tools, dialect), "trusted": True}] + messages[k:]


# ----- constrained calls -----------------------------------------------------------------------------------

def _literal(text: str, tokenizer) -> str:
    """A Lark literal for ``text``: a special token as its id (llguidance's ``<[id]>``), else the string."""
    sid = tokenizer.special_id(text) if hasattr(tokenizer, "special_id") else None
    return f"<[{sid}]>" if sid is not None else json.dumps(text, ensure_ascii=False)


def call_grammar(tools: list[dict], choice: str, parallel: bool, dialect: str, tokenizer) -> str:
    """The Lark grammar of a forced call: ``required`` (one or more calls of any tool, one when not
    ``parallel``) or one call of the tool named ``choice``. Arguments: each tool's schema, compact."""
    lit = lambda s: _literal(s, tokenizer)
    chosen = tools if choice == "required" else [t for t in tools if t["name"] == choice]
    rules = []
    for i, t in enumerate(chosen):
        schema = {**t["parameters"], "x-guidance": {"whitespace_flexible": False}}
        if dialect == V3:
            head = f"{lit(CALL_BEGIN)} \"function\" {lit(SEP)} {json.dumps(t['name'] + chr(10) + '```json' + chr(10))}"
            tail = f"{json.dumps(chr(10) + '```')} {lit(CALL_END)}"
        else:
            head = f"{lit(CALL_BEGIN)} {json.dumps(t['name'])} {lit(SEP)}"
            tail = lit(CALL_END)
        rules.append(f"call_{i}: {head} args_{i} {tail}\nargs_{i}: %json {json.dumps(schema)}")
    sep = ' "\\n" ' if dialect == V3 else " "
    more = f"({sep}call)*" if parallel and choice == "required" else ""
    return "\n".join([f"start: {lit(CALLS_BEGIN)} call {more} {lit(CALLS_END)}",
                      "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))), *rules])


# ----- parsing the output --------------------------------------------------------------------------------

class ToolCallStream:
    """Splits a choice's content, as it arrives, into plain content and tool calls, streamed as vLLM
    streams them: the text before the calls' begin token is content (a possible start of that token is
    held back); each call opens with a delta carrying its index, id, type and name once the name is
    complete, then its arguments arrive as they are generated (a possible start of the call's end held
    back). A call of a tool not offered is dropped. :attr:`calls`: the calls so far, whole."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.buf, self.state = "", "content"     # content, between (calls), head, args, skip
        self.calls: list[dict] = []
        self._head_end = "\n```json\n" if spec.dialect == V3 else ""
        self._args_end = ("\n```" if spec.dialect == V3 else "") + CALL_END

    def add(self, text: str) -> tuple[str, list[dict]]:
        """(the content it settles, the tool-call deltas it brings)."""
        self.buf += text
        content, deltas = "", []
        while True:
            if self.state == "content":
                i = self.buf.find(CALLS_BEGIN)
                if i < 0:
                    k = held_back(self.buf, CALLS_BEGIN)
                    content += self.buf[:len(self.buf) - k]
                    self.buf = self.buf[len(self.buf) - k:]
                    return content, deltas
                content += self.buf[:i]
                self.buf, self.state = self.buf[i + len(CALLS_BEGIN):], "between"
            elif self.state == "between":
                a = self.buf.find(CALL_BEGIN)
                if a < 0:
                    return content, deltas
                self.buf, self.state = self.buf[a + len(CALL_BEGIN):], "head"
            elif self.state == "head":
                j = self.buf.find(SEP)
                if j < 0:
                    return content, deltas
                if self.spec.dialect == V3:
                    e = self.buf.find(self._head_end, j)
                    if e < 0:
                        return content, deltas
                    name, rest = self.buf[j + len(SEP):e].strip(), self.buf[e + len(self._head_end):]
                else:
                    name, rest = self.buf[:j].strip(), self.buf[j + len(SEP):]
                self.buf = rest
                if name not in self.spec.names:
                    self.state = "skip"
                    continue
                call = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": name, "arguments": ""}}
                self.calls.append(call)
                deltas.append({**call, "function": dict(call["function"])})
                self.state = "args"
            elif self.state == "args":
                call = self.calls[-1]
                e = self.buf.find(self._args_end)
                piece = self.buf[:e] if e >= 0 else self.buf[:len(self.buf) - held_back(self.buf, self._args_end)]
                if piece:
                    call["function"]["arguments"] += piece
                    deltas.append({"index": call["index"], "function": {"arguments": piece}})
                if e < 0:
                    self.buf = self.buf[len(piece):]
                    return content, deltas
                self.buf, self.state = self.buf[e + len(self._args_end):], "between"
            else:   # skip: a call of a tool not offered
                e = self.buf.find(CALL_END)
                if e < 0:
                    return content, deltas
                self.buf, self.state = self.buf[e + len(CALL_END):], "between"

    def finish(self) -> str:
        """The content held back at the end (nothing once the calls began)."""
        rest, self.buf = (self.buf if self.state == "content" else ""), ""
        return rest
