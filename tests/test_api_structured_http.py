"""Structured outputs, tool calls, R1's reasoning split and ``logit_bias`` over HTTP, with the official
``openai`` client against the real Serve app on the test cluster: two colocated apps on the embedded
quantized model, ``plain`` at / and ``r1`` (``reasoning_parser: deepseek_r1``, its grammars covering the
reasoning too, so that a regex can shape a whole reasoning-then-answer output) at /r1.

- JSON under a schema, sampled with many seeds: every output parses and validates (jsonschema), finished
  by the model (``stop``), streamed and not; ``guided_choice``, ``guided_regex``, ``guided_grammar``
  (GBNF) and ``structured_outputs`` outputs in their language;
- a forced tool call (named and ``required``, one call), streamed and not: parsed into ``tool_calls``
  whose arguments validate against the tool's schema, greedy and sampled; the streamed call equals the
  non-streamed one (greedy); a tool result rendered back into the prompt;
- the reasoning split, streamed and not, against the plain app's unsplit text of the same greedy request
  (reasoning + ``</think>`` + content == that text; usage unchanged);
- ``logit_bias`` against the engine's greedy choice: +100 on a token makes every output token that
  token; -100 on the unbiased first token changes it;
- each bad schema, grammar, tool, tool choice and bias: a 400 naming the field, the server still up.
"""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from pipeline.engine.config import EngineConfig  # noqa: E402
from serve_apps import deployed  # noqa: E402

MODEL = "tiny-structured"
ENGINE = EngineConfig(num_blocks=96, block_size=16, max_num_seqs=8, max_batched_tokens=256, nz=True)
QUESTION = "Describe a person as JSON."
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member", "color"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "member": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
                                               "additionalProperties": False}}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
# the reasoning test's output: words, the end of the reasoning, words
THINK_REGEX = r"[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[a-z]{2,8}( [a-z]{2,8}){1,2}"


@pytest.fixture(scope="module")
def server(serve_http, qdir):
    from actors.serving.app.serve_app import DeploymentOptions, ServeConfig

    cpu, small = DeploymentOptions(1, {"num_cpus": 0.5}), DeploymentOptions(1, {"num_cpus": 0.1})
    plain = ServeConfig(qdir, MODEL, ENGINE, max_in_flight=16, llm=cpu, ingress=small, reasoning_parser="none")
    # the reasoning split is tested on an output a grammar shapes whole: reasoning, </think>, answer
    r1 = ServeConfig(qdir, MODEL, ENGINE, max_in_flight=16, llm=cpu, ingress=small, reasoning_parser="deepseek_r1",
                     constrain_reasoning=True)
    with deployed({"structured-plain": (plain, "/"), "structured-r1": (r1, "/r1")}):
        yield serve_http


def client(server: str, prefix: str = "") -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server}{prefix}/v1", api_key="none", max_retries=0, timeout=120)


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": kw.pop("question", QUESTION)}], **kw}


def streamed(c, **body) -> tuple[dict, list]:
    """A streamed chat's choice 0 joined: content, reasoning, tool calls (by index), finish reason; and
    the chunks."""
    chunks = list(c.chat.completions.create(stream=True, **body))
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for ch in chunks:
        for choice in ch.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or ():
                call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out, chunks


# ----- structured outputs ----------------------------------------------------------------------------------

def test_json_schema_outputs_validate_for_every_seed(server):
    c = client(server)
    outputs = []
    for seed in (1, 101, 201):      # n=4: seeds seed..seed+3, twelve samples at temperature 1
        r = c.chat.completions.create(**chat(n=4, seed=seed, temperature=1.0, max_tokens=120,
                                             response_format={"type": "json_schema", "json_schema": {
                                                 "name": "person", "schema": SCHEMA, "strict": True}}))
        outputs += [(ch.message.content, ch.finish_reason) for ch in r.choices]
    assert len(outputs) == 12
    for text, finish in outputs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in outputs}) > 1      # sampled, not one output twelve times


def test_json_schema_streamed_is_the_same_output(server):
    c = client(server)
    body = chat(seed=7, temperature=1.0, max_tokens=120, extra_body={"guided_json": SCHEMA})
    whole = c.chat.completions.create(**body).choices[0]
    got, _ = streamed(c, **body)
    assert got["content"] == whole.message.content and got["finish"] == whole.finish_reason == "stop"
    jsonschema.validate(json.loads(got["content"]), SCHEMA)


def test_choice_regex_grammar_and_structured_outputs(server):
    c = client(server)
    colors = ["crimson", "teal", "ochre"]
    r = c.chat.completions.create(**chat(n=4, seed=3, temperature=1.0, max_tokens=20,
                                         extra_body={"guided_choice": colors}))
    assert all(ch.message.content in colors and ch.finish_reason == "stop" for ch in r.choices)
    r = c.chat.completions.create(**chat(n=4, seed=5, temperature=1.0, max_tokens=30,
                                         extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}))
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", ch.message.content) for ch in r.choices), r.choices
    gbnf = 'root ::= "ok " digit digit\ndigit ::= [0-9]'
    r = c.chat.completions.create(**chat(n=2, seed=9, temperature=1.0, max_tokens=20,
                                         extra_body={"guided_grammar": gbnf}))
    assert all(re.fullmatch(r"ok [0-9]{2}", ch.message.content) for ch in r.choices), r.choices
    r = c.completions.create(model=MODEL, prompt="The answer is", max_tokens=20, temperature=1.0, seed=2, n=2,
                             extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(ch.text in ("yes", "no") for ch in r.choices)
    r = c.chat.completions.create(**chat(seed=4, temperature=0.7, max_tokens=200,
                                         response_format={"type": "json_object"}))
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


# ----- tool calls --------------------------------------------------------------------------------------

def _check_calls(calls: list, allowed: set) -> None:
    assert calls
    for name, args in calls:
        assert name in allowed
        jsonschema.validate(json.loads(args), SCHEMAS[name])


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_call_is_parsed_streamed_and_not(server, choice):
    c = client(server)
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    # required with parallel calls allowed lets the model chain calls up to max_tokens: one call here (a
    # grammar of several: tests/test_structured_outputs.py)
    body = chat(question="What is the weather in Paris?", tools=TOOLS, tool_choice=tool_choice, temperature=0,
                max_tokens=150, parallel_tool_calls=False)
    r = c.chat.completions.create(**body).choices[0]
    calls = [(t.function.name, t.function.arguments) for t in r.message.tool_calls or ()]
    _check_calls(calls, {"get_weather"} if choice == "named" else set(SCHEMAS))
    assert all(t.id.startswith("call_") and t.type == "function" for t in r.message.tool_calls)
    assert r.finish_reason == ("stop" if choice == "named" else "tool_calls")
    got, _ = streamed(c, **body)
    assert [(v["name"], v["arguments"]) for _, v in sorted(got["calls"].items())] == calls
    assert got["finish"] == r.finish_reason and got["content"] == (r.message.content or "")
    for seed in range(4):   # sampled: still a valid call every time
        r = c.chat.completions.create(**{**body, "temperature": 1.0, "seed": seed}).choices[0]
        _check_calls([(t.function.name, t.function.arguments) for t in r.message.tool_calls or ()],
                     {"get_weather"} if choice == "named" else set(SCHEMAS))


def test_tool_results_go_back_into_the_prompt(server):
    c = client(server)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    from pipeline.serving.endpoints.openai_api import parse_chat
    from pipeline.text.tokenizer import Tokenizer

    from pipeline.assets import EMBEDDED_MODEL_DIR
    tok = Tokenizer.from_dir(str(EMBEDDED_MODEL_DIR))
    req = parse_chat({"model": MODEL, "messages": messages, "tools": TOOLS}, tok, MODEL, 4096)
    assert r.usage.prompt_tokens == len(req.prompt_ids)
    text = tok.decode(req.prompt_ids, skip_special=False)
    assert "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 21 C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>" in text


# ----- reasoning ---------------------------------------------------------------------------------------

def test_reasoning_is_split_streamed_and_not(server):
    body = chat(temperature=0, max_tokens=60, extra_body={"guided_regex": THINK_REGEX})
    full = client(server).chat.completions.create(**body)           # the plain app: no parser
    text = full.choices[0].message.content
    assert "</think>" in text and "reasoning_content" not in (full.choices[0].message.model_extra or {})
    r1 = client(server, "/r1")
    r = r1.chat.completions.create(**body)
    m = r.choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning + "</think>" + m.content == text and reasoning and m.content
    assert r.usage.completion_tokens == full.usage.completion_tokens
    got, chunks = streamed(r1, **body)
    assert (got["reasoning"], got["content"]) == (reasoning, m.content)
    # every reasoning delta comes before every content delta
    kinds = [("r" if (ch.choices[0].delta.model_extra or {}).get("reasoning_content") else "c")
             for ch in chunks if ch.choices and ((ch.choices[0].delta.model_extra or {}).get("reasoning_content")
                                                 or ch.choices[0].delta.content)]
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds
    # an output without </think> is all reasoning
    r = r1.chat.completions.create(**chat(temperature=0, max_tokens=8, extra_body={"guided_regex": "[a-z ]{4,20}"}))
    assert r.choices[0].message.content is None and r.choices[0].message.model_extra["reasoning_content"]


# ----- logit_bias --------------------------------------------------------------------------------------

def test_logit_bias(server, tok):
    c = client(server)
    base = c.chat.completions.create(**chat(temperature=0, max_tokens=6, logprobs=True))
    first = tok.encode_plain(base.choices[0].logprobs.content[0].token)
    forced = tok.encode_plain(" module")
    assert len(forced) == 1 and len(first) == 1
    r = c.chat.completions.create(**chat(temperature=0, max_tokens=6, logit_bias={str(forced[0]): 100}))
    assert r.choices[0].message.content == " module" * 6
    r = c.chat.completions.create(**chat(temperature=0, max_tokens=6, logit_bias={first[0]: -100}, logprobs=True))
    assert tok.encode_plain(r.choices[0].logprobs.content[0].token) != first


# ----- refusals ----------------------------------------------------------------------------------------

BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format", "nope"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json"),
    ({"guided_regex": "a(("}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "guided_choice"),
    ({"guided_grammar": "start: x ::= "}, "guided_grammar", "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output field"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, "tools",
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "guided_regex"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "99999"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "'x'"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "300"),
]


@pytest.mark.parametrize("extra,param,says", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_fields_are_400_naming_the_field(server, extra, param, says):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**chat(max_tokens=4), extra_body=extra)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and says in err["message"], err
    assert c.chat.completions.create(**chat(max_tokens=2)).choices[0].finish_reason == "length"   # still up
