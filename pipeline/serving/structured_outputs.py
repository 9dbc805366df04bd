"""Structured outputs, pure: the request fields that constrain what the model may write, validated and
turned into one grammar for the engine (``SamplingParams.grammar``, run by
:mod:`pipeline.engine.core.guided` with llguidance).

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's extensions its users send: ``guided_json`` (a schema, object or JSON text), ``guided_regex``,
  ``guided_choice`` (a list of strings: the output is one of them), ``guided_grammar`` (Lark, or GBNF /
  EBNF as llama.cpp writes it: llguidance converts), and the newer ``structured_outputs`` object with one
  of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``.

At most one of them per request (a 400 naming the second otherwise). With R1's reasoning parser on, a
chat's constraint starts after the reasoning (:func:`after_reasoning`: free text up to ``</think>``, then
the constrained answer), as in vLLM. JSON is generated compact (no
whitespace between tokens: ``{"a":1,"b":[2,3]}``; llguidance's ``whitespace_flexible`` off), so that a
model cannot spend its tokens on blank space. Every grammar is compiled here, at validation, with the
API's tokenizer (:func:`compiler_for`, whose compiled grammars are cached per grammar text): one the
engine cannot compile (an unknown type, a dangling ``$ref``, a bad regex or grammar) is a 400 naming the
field, with llguidance's message, and never reaches the engine.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Mapping, Optional

from pipeline.serving.api_errors import invalid

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
FIELDS = ("response_format", "structured_outputs") + GUIDED_FIELDS
COMPACT_JSON = {"whitespace_flexible": False}   # llguidance JsonCompileOptions: no free whitespace

_lock = threading.Lock()
_compilers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiler_for(tokenizer):
    """The grammar compiler of ``tokenizer`` (one per tokenizer object, built on first use)."""
    from pipeline.engine.core.guided import GrammarCompiler

    with _lock:
        c = _compilers.get(tokenizer)
        if c is None:
            c = _compilers[tokenizer] = GrammarCompiler(tokenizer)
    return c


def json_schema_grammar(schema: Any) -> str:
    """The llguidance grammar of a JSON schema (a dict), compact."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)


def compile_or_400(tokenizer, grammar: str, where: str, param: str) -> str:
    """``grammar`` once it compiles; else a 400 naming ``where`` (the field's path) and ``param``."""
    from pipeline.engine.core.guided import GrammarError

    try:
        compiler_for(tokenizer).check(grammar)
    except GrammarError as e:
        raise invalid(f"{where}: the grammar engine cannot compile it: {str(e).strip()}", param) from None
    return grammar


def _schema(value: Any, where: str, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid(f"{where} must be a JSON schema (an object, or its JSON text): {e}", param) from None
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON schema object, got {type(value).__name__}", param)
    return value


def _text(value: Any, where: str, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{where} must be a non-empty string, got {value!r}", param)
    return value


def _choice_grammar(value: Any, where: str, param: str) -> str:
    from llguidance import grammar_from

    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise invalid(f"{where} must be a non-empty list of non-empty strings, got {value!r}", param)
    return grammar_from("choice", json.dumps(value))


def _grammar_text(value: Any, where: str, param: str) -> str:
    from llguidance import grammar_from

    try:
        return grammar_from("grammar", _text(value, where, param))   # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise invalid(f"{where}: {e}", param) from None


def _response_format(rf: Any) -> Optional[tuple[str, str]]:
    """(grammar, field path) of ``response_format``, None for text."""
    p = "response_format"
    if not isinstance(rf, dict):
        raise invalid(f"response_format must be an object like {{'type': 'json_object'}}, got {rf!r}", p)
    kind = rf.get("type")
    unknown = sorted(set(rf) - {"type", "json_schema"})
    if unknown:
        raise invalid(f"response_format: unrecognized key(s) {', '.join(unknown)}", p)
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}), "response_format"
    if kind != "json_schema":
        raise invalid(f"response_format.type must be one of text, json_object, json_schema, got {kind!r}", p)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise invalid("response_format.json_schema must be an object with a 'schema' (and 'name', 'strict')", p)
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise invalid(f"response_format.json_schema: unrecognized key(s) {', '.join(unknown)}", p)
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"response_format.json_schema.name must be a string, got {name!r}", p)
    if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
        raise invalid(f"response_format.json_schema.strict must be a boolean, got {js['strict']!r}", p)
    if "schema" not in js:
        raise invalid("response_format.json_schema.schema is required", p)
    where = "response_format.json_schema.schema"
    return json_schema_grammar(_schema(js["schema"], where, p)), where


def _structured(so: Any) -> tuple[str, str]:
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise invalid(f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KEYS)}", p)
    keys = [k for k in so if so[k] is not None and so[k] is not False]
    unknown = sorted(set(keys) - set(STRUCTURED_KEYS))
    if unknown:
        raise invalid(f"structured_outputs: unrecognized key(s) {', '.join(unknown)} (known: "
                      f"{', '.join(STRUCTURED_KEYS)})", p)
    if len(keys) != 1:
        raise invalid(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KEYS)}, got "
                      f"{len(keys)}", p)
    k = keys[0]
    where = f"structured_outputs.{k}"
    if k == "json":
        return json_schema_grammar(_schema(so[k], where, p)), where
    if k == "json_object":
        if so[k] is not True:
            raise invalid(f"structured_outputs.json_object must be true, got {so[k]!r}", p)
        return json_schema_grammar({"type": "object"}), where
    return _guided(k, so[k], where, p), where


def _guided(kind: str, value: Any, where: str, param: str) -> str:
    from llguidance import LLMatcher

    if kind == "json":
        return json_schema_grammar(_schema(value, where, param))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(_text(value, where, param))
    if kind == "choice":
        return _choice_grammar(value, where, param)
    return _grammar_text(value, where, param)


def parse_structured(body: Mapping[str, Any], tokenizer) -> Optional[tuple[str, str]]:
    """(the compiled-checked grammar, the field that asked for it) for the request's structured-output
    field, or None without one; a 400 naming the field for a bad value or a second such field."""
    given = [f for f in FIELDS if body.get(f) is not None]
    found: list[tuple[str, str]] = []
    for f in given:
        if f == "response_format":
            got = _response_format(body[f])
        elif f == "structured_outputs":
            got = _structured(body[f])
        else:
            got = _guided(f[len("guided_"):], body[f], f, f), f
        if got is not None:
            found.append((got[0], f if f in GUIDED_FIELDS else got[1]))
    if not found:
        return None
    if len(found) > 1:
        second = found[1][1].split(".")[0]
        raise invalid(f"give one structured-output field, got {found[0][1].split('.')[0]} and {second}", second)
    grammar, where = found[0]
    return compile_or_400(tokenizer, grammar, where, where.split(".")[0]), where.split(".")[0]


# R1 reasons freely first: any text up to </think>, then the constrained answer (as vLLM starts the grammar
# after the reasoning ends); the answer's grammar is referenced as a grammar of its own
_REASONING_FIRST = 'start: reasoning @answer\nreasoning[stop="</think>"]: /(.|\\n)*/'


def after_reasoning(grammar: str) -> str:
    """``grammar`` (an llguidance grammar: its JSON form, or Lark text) preceded by free reasoning that
    ends with ``</think>``."""
    if grammar.lstrip().startswith("{"):
        top = json.loads(grammar)
        answer, rest = dict(top["grammars"][0]), top["grammars"][1:]
    else:
        answer, rest = {"lark_grammar": grammar}, []
    answer["name"] = "answer"
    return json.dumps({"grammars": [{"lark_grammar": _REASONING_FIRST}, answer, *rest]})