"""The decoder layer as the engine runs it over one step's tokens, written once (:func:`forward`) and run three
ways: eager (:class:`EagerOps`, the reference), with its work around attention compiled (``EagerOps(compile=
True)``, EngineConfig.compile), and captured into a replayed decode step (pipeline.engine.worker.decode_graph's
ops bind each call to persistent tensors). A sharded replica runs it eagerly on its sharded modules.

Per layer and step (shapes: N tokens, H heads; ``ops`` does each call)::

    attn_in    x = input_layernorm(h);  q = q_b(norm(q_a(x))) (or q_proj(x)) -> q_nope, rope(q_pe)
               c, k_pe = kv_a(x);  c = kv_a_layernorm(c);  rope(k_pe)
    write      the tokens' latents into the paged cache
    attend     attention over the cache (decode rows and prefill chunks), o [N, H, d_v] before o_proj
    attn_out   h = h + o_proj(o);  x = post_attention_layernorm(h)
    ffn        h = h + mlp(x)      (a dense MLP or a MoE)

``write`` and ``attend`` are the attention backend's (pipeline.engine.attention.backends); the others are
the modules' own calls. Compiled, ``attn_in``, ``attn_out`` and a dense layer's ``ffn`` are each a few fused
C++ loops instead of tens of small ops (on the torch path; the C kernels leave little to fuse). The fused
float arithmetic is not bit-identical to eager
(reassociation, fused SiLU: max |diff| ~5e-7 on outputs of size ~1), so the tests compare compiled against
eager with a stated tolerance, and every exactness test runs eager. With ``inline_inbuilt_nn_modules``
(torch's default) the layers share one graph per region, the parameters being inputs; sizes are dynamic (a
second graph for one token). A MoE layer's ``ffn`` stays eager (its per-expert grouping reads the router's
choice on the host, a graph break).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from pipeline.model.ffn import MLP
from pipeline.model.rope import apply_rope


class Ops(Protocol):
    """What :func:`forward` calls: a module's call, rope, the residual add, the attention backend's write
    and attend, and :meth:`region` (a stage as one unit: eager, compiled or captured)."""

    def norm(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor: ...
    def linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor: ...
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...
    def add(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...
    def mlp(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor: ...
    def write(self, cache, step, c: torch.Tensor, k_pe: torch.Tensor) -> None: ...
    def attend(self, attn: nn.Module, cache, step, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor: ...
    def region(self, name: str, fn: Callable, *args): ...


def forward(ops: Ops, layer: nn.Module, cache, h: torch.Tensor, step) -> torch.Tensor:
    """The decoder layer ``layer`` over the step's tokens: h [1, N, hidden] -> h (module docstring); its
    cache ``cache``, ``step`` what the step's attention reads (pipeline.engine.attention.backends.StepInputs)."""
    q_nope, q_pe, c, k_pe = ops.region("attn_in", attn_in, layer, h, step.cos, step.sin)
    ops.write(cache, step, c, k_pe)
    o = ops.attend(layer.self_attn, cache, step, q_nope, q_pe)
    h, x = ops.region("attn_out", attn_out, layer, h, o)
    return ops.region("dense_ffn" if isinstance(layer.mlp, MLP) else "ffn", ffn, layer, h, x)


# ----- the stages ----------------------------------------------------------------------------------------

def attn_in(ops: Ops, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """h [1, N, hidden] -> (q_nope [1, N, H, d_n], rotated q_pe [1, N, H, d_r], normed latent c [1, N, C],
    rotated k_pe [1, N, d_r]): MLA's projections (pipeline.model.mla.MLA.query / latent, op for op)."""
    attn = layer.self_attn
    x = ops.norm(layer.input_layernorm, h)
    if hasattr(attn, "q_a_proj"):
        q = ops.linear(attn.q_b_proj, ops.norm(attn.q_a_layernorm, ops.linear(attn.q_a_proj, x)))
    else:
        q = ops.linear(attn.q_proj, x)
    q_nope, q_pe = q.unflatten(-1, (attn.H, attn.d_n + attn.d_r)).split([attn.d_n, attn.d_r], dim=-1)
    q_pe = ops.rope(q_pe, cos, sin)
    c, k_pe = ops.linear(attn.kv_a_proj_with_mqa, x).split([attn.C, attn.d_r], dim=-1)
    c = ops.norm(attn.kv_a_layernorm, c)
    return q_nope, q_pe, c, ops.rope(k_pe, cos, sin)


def attn_out(ops: Ops, layer: nn.Module, h: torch.Tensor, o: torch.Tensor):
    """o [N, H, d_v] float32 (attention's output, before o_proj) -> (h + o_proj(o), its post-attention norm)."""
    o = o.to(h.dtype)
    h = ops.add(h, ops.linear(layer.self_attn.o_proj, o.reshape(o.shape[0], -1)[None]))
    return h, ops.norm(layer.post_attention_layernorm, h)


def ffn(ops: Ops, layer: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ops.add(h, ops.mlp(layer.mlp, x))


# ----- eager (and compiled) ------------------------------------------------------------------------------

class EagerOps:
    """The calls made as they come, on an attention ``backend`` (write / attend); ``rope``: apply_rope or a
    function with its bits (the engine's C one). ``compile``: the stages around attention through
    torch.compile (``mode`` for it; they keep apply_rope, which torch.compile fuses)."""

    def __init__(self, backend, rope: Optional[Callable] = None, compile: bool = False, mode: Optional[str] = None):
        self.backend = backend
        self.compiled = bool(compile)
        self.rope_fn: Callable = apply_rope if compile or rope is None else rope
        self._regions: dict[str, Callable] = {}
        if compile:
            import torch._dynamo

            # one graph per region serves every layer (parameters as inputs); leave room for the sizes
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            for name, fn in (("attn_in", attn_in), ("attn_out", attn_out), ("dense_ffn", ffn)):
                self._regions[name] = torch.compile(functools.partial(fn, self), dynamic=True, mode=mode)

    def norm(self, mod, x):
        return mod(x)

    def linear(self, mod, x):
        return mod(x)

    def mlp(self, mod, x):
        return mod(x)

    def rope(self, x, cos, sin):
        return self.rope_fn(x, cos, sin)

    def add(self, h, y):
        return h + y

    def write(self, cache, step, c, k_pe) -> None:
        self.backend.write(cache, step.slots, c[0], k_pe[0])

    def attend(self, attn, cache, step, q_nope, q_pe):
        return self.backend.attend(attn, cache, step, q_nope, q_pe)

    def region(self, name: str, fn: Callable, *args):
        compiled = self._regions.get(name)
        return compiled(*args) if compiled is not None else fn(self, *args)
