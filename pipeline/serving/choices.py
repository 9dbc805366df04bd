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
"""

from __future__ import annotations

from typing import Optional

from pipeline.engine.core.detokenizer import Detokenizer
from pipeline.serving.logprobs import LogprobsBuilder, TokenStrings
from pipeline.serving.openai_api import CHAT, GenerateRequest
from pipeline.serving.openai_responses import choice, stream_chunk


class ChoiceState:
    def __init__(self, req: GenerateRequest, index: int, tokenizer, strings: Optional[TokenStrings] = None):
        self.req, self.index = req, index
        self.detok = Detokenizer(tokenizer, req.params.stop)    # for outputs without the engine's text
        self.text = ""                  # the text so far
        self.tokens = 0                 # generated tokens so far
        self.finish_reason: Optional[str] = None
        k = req.params.logprobs
        self.logprobs = None if k is None else LogprobsBuilder(req.kind == CHAT, strings or TokenStrings(tokenizer), k)

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
        if ev.finish_reason is None and not text and lp is None:
            return None
        return stream_chunk(self.req, created, text, ev.finish_reason, index=self.index, logprobs=lp,
                            completion_tokens=completion_tokens)

    def result(self) -> dict:
        """The choice of the non-streaming response (a completion's text after its echo)."""
        text = (self.req.echo or "") + self.text
        return choice(self.req, self.index, text, self.finish_reason,
                      None if self.logprobs is None else self.logprobs.payload)
