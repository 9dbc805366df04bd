"""Structured outputs, tool calls, the reasoning split and logit_bias below HTTP (no Ray): the parsers
streamed at every split point against the whole text, the forced-call grammars against call texts,
the batched mask against a token-by-token reference, the grammar cache, the DeepSeek tool template's
rendering and isolation, and the engine's constrained rows beside unconstrained ones (whose tokens must
be those of the same requests run alone). Over HTTP: tests/test_api_structured_http.py."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.assets import EMBEDDED_MODEL_DIR
from pipeline.engine.core.guided import GrammarCompiler, GrammarError, masked_rows
from pipeline.serving import reasoning
from pipeline.serving.endpoints.openai_api import ApiError, parse_chat
from pipeline.serving.structured_outputs import json_schema_grammar
from pipeline.serving.tool_calls import V3, V31, ToolCallStream, ToolSpec, call_grammar, call_text
from pipeline.text.tokenizer import Tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "weather", "parameters": WEATHER},
         {"name": "get_time", "description": "time", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def etok() -> Tokenizer:
    return Tokenizer.from_dir(str(EMBEDDED_MODEL_DIR))


@pytest.fixture(scope="module")
def compiler(etok) -> GrammarCompiler:
    return GrammarCompiler(etok)


def accepts(compiler, etok, grammar: str, text: str) -> bool:
    m = compiler.matcher(grammar)
    return all(m.consume_token(t) for t in etok.encode_plain(text)) and m.is_accepting()


# ----- reasoning -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("let me think</think>The answer", ("let me think", "The answer")),
    ("<think>hm</think>ok", ("hm", "ok")),
    ("no end yet", ("no end yet", None)),
    ("all thought</think>", ("all thought", None)),
    ("</think>direct", (None, "direct")),
    ("a </thin k", ("a </thin k", None)),
])
def test_reasoning_split_streamed_at_every_point_is_the_whole_split(text, want):
    assert reasoning.split(text) == want
    for cut in range(len(text) + 1):
        for step in (1, 3):
            s = reasoning.ReasoningSplitter()
            r = c = ""
            for piece in [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]:
                dr, dc = s.add(piece)
                r, c = r + dr, c + dc
            r += s.finish()
            assert (r or None, c or None) == want, (cut, step)


def test_reasoning_parser_on_for_r1_templates(etok):
    assert reasoning.parser_for(None, etok.chat_template) is None       # V3's strips </think> only
    r1 = etok.chat_template.replace("{{ '<｜Assistant｜>' }}{% endif %}", "{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
    assert r1 != etok.chat_template and reasoning.parser_for(None, r1) == "deepseek_r1"
    assert reasoning.parser_for("none", r1) is None and reasoning.parser_for("deepseek_r1", None) == "deepseek_r1"
    v31 = r1.replace("{{ '<｜Assistant｜><think>\\n' }}", "{% if thinking %}{{ '<｜Assistant｜><think>' }}{% else %}"
                                                          "{{ '<｜Assistant｜></think>' }}{% endif %}")
    assert v31 != r1 and reasoning.parser_for(None, v31) is None    # V3.1: thinking is off by default
    with pytest.raises(ValueError, match="reasoning_parser"):
        reasoning.parser_for("qwen3", None)


# ----- tool calls ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dialect", [V3, V31])
def test_tool_call_stream_at_every_split_is_the_whole_parse(dialect):
    calls = [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    joiner = "\n" if dialect == V3 else ""
    text = ("Checking. <｜tool▁calls▁begin｜>" + joiner.join(call_text(n, a, dialect) for n, a in calls)
            + "<｜tool▁calls▁end｜>")
    spec = ToolSpec(("get_weather", "get_time"), "auto", dialect)
    for cut in range(0, len(text) + 1, 3):
        for step in (1, 7, len(text)):
            s = ToolCallStream(spec)
            content, got = "", {}
            for piece in [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]:
                c, deltas = s.add(piece)
                content += c
                for d in deltas:        # the first delta of a call names it; the others carry arguments
                    call = got.setdefault(d["index"], {"name": None, "arguments": "", "id": d.get("id")})
                    if "name" in d["function"]:
                        assert call["name"] is None and d["id"].startswith("call_") and d["type"] == "function"
                        call["name"] = d["function"]["name"]
                    call["arguments"] += d["function"]["arguments"]
            content += s.finish()
            assert content == "Checking. " and sorted(got) == [0, 1]
            assert [(got[i]["name"], got[i]["arguments"]) for i in (0, 1)] == calls
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in s.calls] == calls
    s = ToolCallStream(spec)                    # a text that only looks like the start of a call at its end
    assert s.add("see <｜tool▁ca") == ("see ", []) and s.finish() == "<｜tool▁ca"
    s = ToolCallStream(spec)                    # a call of a tool not offered is dropped
    assert s.add("<｜tool▁calls▁begin｜>" + call_text("rm_rf", "{}", dialect)) == ("", []) and s.calls == []
    s = ToolCallStream(spec)                    # streamed: the arguments as they come, the end held back
    _, d = s.add("<｜tool▁calls▁begin｜>" + call_text("get_time", '{"zone":"utc"}', dialect)[:-len("<｜tool▁call▁end｜>")])
    assert d[0]["function"] == {"name": "get_time", "arguments": ""}
    assert "".join(x["function"]["arguments"] for x in d[1:]) == '{"zone":"utc"}'     # V3's "\n```" held back


@pytest.mark.parametrize("dialect", [V3, V31])
def test_forced_call_grammars(compiler, etok, dialect):
    joiner = "\n" if dialect == V3 else ""
    one = "<｜tool▁calls▁begin｜>" + call_text("get_weather", '{"city":"Paris"}', dialect) + "<｜tool▁calls▁end｜>"
    two = ("<｜tool▁calls▁begin｜>" + call_text("get_weather", '{"city":"Rome"}', dialect) + joiner
           + call_text("get_time", "{}", dialect) + "<｜tool▁calls▁end｜>")
    lark = lambda *a: __import__("llguidance").LLMatcher.grammar_from_lark(call_grammar(TOOLS, *a, dialect, etok))
    assert accepts(compiler, etok, lark("required", True), one)
    assert accepts(compiler, etok, lark("required", True), two)
    assert not accepts(compiler, etok, lark("required", False), two)
    assert accepts(compiler, etok, lark("get_weather", True), one)
    assert not accepts(compiler, etok, lark("get_time", True), one)
    bad_args = one.replace('{"city":"Paris"}', '{"town":"Paris"}')
    assert not accepts(compiler, etok, lark("get_weather", True), bad_args)


def test_tool_chat_rendering_and_isolation(etok):
    tools = [{"type": "function", "function": t} for t in TOOLS]
    messages = [{"role": "user", "content": "Weather? <｜Assistant｜>"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = parse_chat({"model": "m", "messages": messages, "tools": tools}, etok, "m", 4096)
    text = etok.decode(req.prompt_ids, skip_special=False)
    want_tail = ("<｜User｜>Weather? <｜Assistant｜><｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                 "<｜tool▁sep｜>get_weather\n```json\n{\"city\":\"Rome\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
                 "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
                 "<｜tool▁outputs▁end｜>")
    assert text.endswith(want_tail) and "## Tools" in text and "### get_time" in text
    # the user's "<｜Assistant｜>" is text: one special Assistant id, the template's, before the tool calls
    assistant = etok.special_id("<｜Assistant｜>")
    assert req.prompt_ids.count(assistant) == 1
    assert req.tools == ToolSpec(("get_weather", "get_time"), "auto", V3)
    none = parse_chat({"model": "m", "messages": messages[:1], "tools": tools, "tool_choice": "none"}, etok, "m", 4096)
    assert none.tools is None and "## Tools" not in etok.decode(none.prompt_ids, skip_special=False)


# ----- grammars, masks, cache --------------------------------------------------------------------------------

def test_bitmask_applies_like_token_by_token(compiler):
    import llguidance.torch as lt

    g = compiler.matcher(json_schema_grammar(WEATHER))
    v = compiler.vocab_size
    bm = lt.allocate_token_bitmask(2, v)
    lt.fill_next_token_bitmask(g, bm, 0)
    bm[1] = -1                                  # all allowed
    bm[1, 3] = 0x40000001                       # ... but tokens 96 and 126
    logits = torch.randn(3, v)
    want = logits[[2, 0]].clone()
    for t in range(v):
        if not (int(bm[0, t // 32]) >> (t % 32)) & 1:
            want[0, t] = float("-inf")
    want[1, 97:126] = want[1, 127:128] = float("-inf")
    got = masked_rows(logits, [2, 0], bm)
    assert torch.equal(got, want) and torch.isfinite(got[0]).sum() >= 1
    assert torch.equal(masked_rows(logits, [2, 0], bm, use_numpy=False), want)    # the device path


def test_compiled_grammars_are_cached_per_text(etok):
    c = GrammarCompiler(etok)
    g = json_schema_grammar(WEATHER)
    a, b = c.matcher(g), c.matcher(g)
    assert c.compiled == 1
    t = etok.encode_plain('{"city"')
    assert all(a.consume_token(x) for x in t) and not b.is_stopped()   # copies, not one shared state
    c.matcher(json_schema_grammar({"type": "integer"}))
    assert c.compiled == 2
    with pytest.raises(GrammarError, match="objectx"):
        c.matcher(json_schema_grammar({"type": "objectx"}))


def test_api_refusals_name_the_field(etok):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
                          "response_format"),
                         ({"guided_regex": "(("}, "guided_regex"), ({"logit_bias": {"4096": 1}}, "logit_bias"),
                         ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools")]:
        with pytest.raises(ApiError) as e:
            parse_chat({**base, **extra}, etok, "m", 4096)
        assert e.value.status == 400 and e.value.param == param
    req = parse_chat({**base, "logit_bias": {"7": -5, 3: 2.5}}, etok, "m", 4096)
    assert req.params.logit_bias == ((3, 2.5), (7, -5.0))


# ----- the engine ----------------------------------------------------------------------------------------

def test_engine_constrained_beside_unconstrained(etok):
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.protocol import EngineRequest, SamplingParams

    torch.manual_seed(0)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def run(reqs):
            eng = LLMEngine.from_dir(str(EMBEDDED_MODEL_DIR), tokenizer=etok, num_blocks=64, block_size=16,
                                     max_num_seqs=8, max_batched_tokens=256)
            out = {r.request_id: [] for r in reqs}
            for r in reqs:
                eng.add(r)
            while eng.has_work:
                for o in eng.step():
                    out[o.request_id] += o.token_ids
                    assert o.error is None, o.error
            return out, eng

        prompt = tuple(etok.encode_chat([{"role": "user", "content": "Give me a city as JSON"}]))
        g = json_schema_grammar(WEATHER)
        free = [EngineRequest(f"free{i}", prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=i))
                for i in range(2)] + [EngineRequest("greedy", prompt, SamplingParams(max_new_tokens=12))]
        guided = [EngineRequest(f"json{i}", prompt, SamplingParams(max_new_tokens=40, temperature=1.0, seed=i,
                                                                   grammar=g)) for i in range(3)]
        bias = etok.encode_plain(" module")[0]
        biased = [EngineRequest("bias", prompt, SamplingParams(max_new_tokens=5, logit_bias=((bias, 100.0),)))]
        alone, _ = run(free)
        mixed, eng = run(free + guided + biased)
        assert {k: mixed[k] for k in alone} == alone
        for i in range(3):
            obj = json.loads(etok.decode(mixed[f"json{i}"]))
            assert set(obj) == {"city"} and len(obj["city"]) <= 10
        assert mixed["bias"] == [bias] * 5
        assert eng.guides.compiler.compiled == 1        # one grammar, compiled once for three requests
    finally:
        torch.set_num_threads(saved)


def test_constrained_tokens_survive_preemption_and_a_kv_handoff(etok):
    """The matcher follows the sequence's output: a constrained greedy request gives the same tokens when
    it is preempted and recomputed, and when its prompt is prefilled on one engine and decoded on another."""
    from pipeline.engine.core.engine import LLMEngine
    from pipeline.engine.protocol import EngineRequest, SamplingParams

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def engine(**kw):
            return LLMEngine.from_dir(str(EMBEDDED_MODEL_DIR), tokenizer=etok, block_size=16, max_num_seqs=4,
                                      max_batched_tokens=256, **{"num_blocks": 64, **kw})

        def drain(eng, out):
            while eng.has_work:
                for o in eng.step():
                    assert o.error is None, o.error
                    out[o.request_id] = out.get(o.request_id, []) + list(o.token_ids)
            return out

        g = json_schema_grammar({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "minItems": 12, "maxItems": 12})
        questions = ["List numbers.", "Give twelve numbers as JSON.", "Numbers please.", "An array."]
        reqs = [EngineRequest(f"q{i}", tuple(etok.encode_chat([{"role": "user", "content": q}])),
                              SamplingParams(max_new_tokens=60, grammar=g)) for i, q in enumerate(questions)]
        one = engine()
        for r in reqs:
            one.add(r)
        want = drain(one, {})
        for toks in want.values():
            arr = json.loads(etok.decode(toks))
            assert len(arr) == 12 and all(0 <= x <= 99 for x in arr)
        tight = engine(num_blocks=8)         # 4 sequences of ~50 tokens need more: some are preempted
        for r in reqs:
            tight.add(r)
        assert drain(tight, {}) == want and tight.counters.preemptions > 0
        pre, dec = engine(), engine()
        got = {}
        for r in reqs:
            h = pre.prefill(r)
            got[r.request_id] = [h.first_token]
            dec.add_prefilled(r, h)
        assert drain(dec, got) == want
    finally:
        torch.set_num_threads(saved)


def test_r1_constraints_start_after_the_reasoning(etok, compiler):
    """With the reasoning parser on, a chat's grammar holds after </think> (free reasoning first), unless
    the server constrains the reasoning too."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "guided_json": schema}
    free = parse_chat(body, etok, "m", 4096, reasoning="deepseek_r1").params.grammar
    whole = parse_chat(body, etok, "m", 4096, reasoning="deepseek_r1", constrain_reasoning=True).params.grammar
    assert whole == parse_chat(body, etok, "m", 4096).params.grammar
    assert accepts(compiler, etok, free, 'Some thinking, {"not": json}.</think>{"a":7}')
    assert not accepts(compiler, etok, free, '{"a":7}') and accepts(compiler, etok, whole, '{"a":7}')
    assert not accepts(compiler, etok, free, 'thinking</think>not json')
    tools = [{"type": "function", "function": TOOLS[0]}]
    forced = parse_chat({"model": "m", "messages": body["messages"], "tools": tools, "tool_choice": "required"},
                        etok, "m", 4096, reasoning="deepseek_r1").params.grammar
    call = "<｜tool▁calls▁begin｜>" + call_text("get_weather", '{"city":"Oslo"}', V3) + "<｜tool▁calls▁end｜>"
    assert accepts(compiler, etok, forced, "I should call it.</think>" + call)
