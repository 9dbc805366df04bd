"""One choice of a generation request as its engine outputs arrive, pure: :class:`ChoiceState` turns each
``EngineOutput`` into the choice's new text (the engine's, for a request with stop strings, which the
engine detokenizes; else decoded here, incrementally), its tokens' logprobs
(:mod:`pipeline.serving.logprobs`) and, streaming, the chunk to send; at the end, the choice of the
non-streaming response. The ingress runs one per choice (``n`` of them) and merges their chunks.

Streaming (vLLM's and OpenAI's shape): a chat choice opens with a chunk carrying the assistant role, a
completion with ``echo`` with a chunk carrying the prompt text. Then a chunk per output that settles text
(or, with logprobs, carries tokens: their logprobs go out with the output even while their text is held
back). The finish reason rides on the chunk of the output that ends the choice, with that output's text
and the text held back until then; that chunk is empty only when the choice ended without a new token
(e.g. an eos, which is not part of the output, or an abort).

A chat choice's text then goes through the request's reasoning parser (:mod:`pipeline.serving.reasoning`:
``reasoning_content`` deltas until ``</think>``) and its tool-call parser (:mod:`pipeline.serving.tool_calls`:
``tool_calls`` deltas for the calls, ``content`` for the text before them); a choice that made tool
calls (not forced by name) finishes with ``tool_calls``, as OpenAI's do.
"""

from __future__ import annotations

from typing import Optional

from pipeline.engine.core.detokenizer import Detokenizer
from pipeline.serving.logprobs import LogprobsBuilder, TokenStrings
from pipeline.serving.endpoints.openai_api import CHAT, GenerateRequest
from pipeline.serving.endpoints.openai_responses import choice, stream_chunk
from pipeline.serving.reasoning import ReasoningSplitter
from pipeline.serving.tool_calls import ToolCallStream


class ChoiceState:
    def __init__(self, req: GenerateRequest, index: int, tokenizer, strings: Optional[TokenStrings] = None):
        self.req, self.index = req, index
        self.detok = Detokenizer(tokenizer, req.params.stop)    # for outputs without the engine's text
        self.text = ""                  # the text so far
        self.tokens = 0                 # generated tokens so far
        self.finish_reason: Optional[str] = None
        k = req.params.logprobs
        self.logprobs = None if k is None else LogprobsBuilder(req.kind == CHAT, strings or TokenStrings(tokenizer), k)
        self.reasoning = ReasoningSplitter() if req.kind == CHAT and req.reasoning else None
        self.tool_stream = ToolCallStream(req.tools) if req.kind == CHAT and req.tools is not None else None
        self.reasoning_text, self.content = "", ""      # the parsed parts so far (chat with parsers)

    @property
    def parsed(self) -> bool:
        """Whether the text is split into reasoning, content and tool calls."""
        return self.reasoning is not None or self.tool_stream is not None

    def _split(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        """A text delta as (reasoning, content, tool-call) deltas; ``final``: flush what is held back."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.add(text)
        if final and self.reasoning is not None:
            reasoning += self.reasoning.finish()
        calls: list[dict] = []
        if self.tool_stream is not None:
            content, calls = self.tool_stream.add(content)
            if final:
                content += self.tool_stream.finish()
        self.reasoning_text += reasoning
        self.content += content
        return reasoning, content, calls

    @property
    def tool_calls(self) -> list[dict]:
        """The tool calls parsed so far, whole."""
        return self.tool_stream.calls if self.tool_stream is not None else []

    @property
    def reported_finish(self) -> Optional[str]:
        """The finish reason the client sees: ``tool_calls`` when the choice made calls it was not forced
        to make by name."""
        if self.tool_calls and self.finish_reason == "stop" and not self.req.tools.named:
            return "tool_calls"
        return self.finish_reason

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, ev) -> tuple[str, Optional[dict]]:
        """Take an output: the text it settles (with the rest once it finishes the choice) and its tokens'
        logprobs payload (None without logprobs or without tokens)."""
        if ev.text is not None:
            text = ev.text
        else:
            text = self.detok.add(ev.token_ids) if ev.token_ids else ""
            if ev.finish_reason is not None:
                text += self.detok.finish()
        self.text += text
        self.tokens += len(ev.token_ids)
        lp = self.logprobs.add(ev.token_ids, ev.logprobs) if self.logprobs is not None and ev.token_ids else None
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
        return text, lp

    def opening(self, created: int) -> Optional[dict]:
        """The chunk that opens the choice's stream, if any: the chat role, or a completion's echo."""
        if self.req.kind == CHAT:
            return stream_chunk(self.req, created, "", first=True, index=self.index)
        if self.req.echo:
            return stream_chunk(self.req, created, self.req.echo, index=self.index)
        return None

    def chunk(self, ev, created: int, completion_tokens: int) -> Optional[dict]:
        """Take an event; the chunk to stream for it, if any (``completion_tokens``: all the choices' so far,
        this event's included, for continuous usage)."""
        text, lp = self.add(ev)
        if self.parsed:
            reasoning, content, calls = self._split(text, ev.finish_reason is not None)
            if ev.finish_reason is None and not (reasoning or content or calls) and lp is None:
                return None
            return stream_chunk(self.req, created, content, self.reported_finish, index=self.index, logprobs=lp,
                                completion_tokens=completion_tokens, reasoning=reasoning, tool_calls=calls)
        if ev.finish_reason is None and not text and lp is None:
            return None
        return stream_chunk(self.req, created, text, ev.finish_reason, index=self.index, logprobs=lp,
                            completion_tokens=completion_tokens)

    def result(self) -> dict:
        """The choice of the non-streaming response (a completion's text after its echo)."""
        text = (self.req.echo or "") + self.text
        lp = None if self.logprobs is None else self.logprobs.payload
        if not self.parsed:
            return choice(self.req, self.index, text, self.finish_reason, lp)
        self.reasoning_text = self.content = ""
        if self.reasoning is not None:
            self.reasoning = ReasoningSplitter()
        if self.tool_stream is not None:
            self.tool_stream = ToolCallStream(self.req.tools)
        self._split(text, True)
        return choice(self.req, self.index, self.content or None if self.tool_calls or self.reasoning else self.content,
                      self.reported_finish, lp,
                      reasoning=self.reasoning_text or None if self.reasoning is not None else False,
                      tool_calls=[{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls])
