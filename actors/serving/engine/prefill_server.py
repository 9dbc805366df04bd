"""The prefill deployment of the disaggregated mode: an engine that runs prompts to their first token and
hands each prompt's cache blocks (int8 latent, NZ when on, the MTP layer's too) back to the caller, the
decode deployment, through Ray's object store (``LLMEngine.prefill``). Prompts are prefilled one at a time
per replica, on a worker thread so the replica keeps answering health checks. A prompt whose prefill fails
(``LLMEngine.prefill`` raises) leaves nothing behind in the engine, so the next prompt is unaffected; should
the engine still hold work between prefills, :meth:`PrefillServer.check_health` fails and Serve replaces the
replica rather than let it fail every later request."""

import asyncio
import threading

from ray import serve

from actors.serving.serve_config import ServeConfig


@serve.deployment(name="PrefillServer")
class PrefillServer:
    def __init__(self, config: ServeConfig):
        import torch

        from actors.serving.engine.engine_replica import make_engine
        from pipeline.text.tokenizer import Tokenizer

        torch.set_num_threads(config.torch_threads)
        tok = Tokenizer.from_dir(config.model_path)
        self.engine = make_engine(config, "prefill", tok)
        self.lock = threading.Lock()
        self.prefilled = 0

    def _prefill(self, request):
        with self.lock:
            kv = self.engine.prefill(request)
            self.prefilled += 1
            return kv

    async def prefill(self, request):
        """The KVHandoff of one EngineRequest's prompt (its first token and cache blocks)."""
        return await asyncio.to_thread(self._prefill, request)

    def check_health(self) -> None:
        broken = getattr(self.engine.runner, "broken", None)
        if broken:
            raise RuntimeError(f"a rank of this sharded prefill replica failed: {broken}")
        if not self.lock.locked() and self.engine.has_work:
            raise RuntimeError("the prefill engine holds sequences between prefills: its state is broken")

    async def layout(self) -> dict:
        return self.engine.kv_layout()

    async def stats(self) -> dict:
        return {"prefilled": self.prefilled, "cache_blocks_free": self.engine.stats().cache_blocks_free}
