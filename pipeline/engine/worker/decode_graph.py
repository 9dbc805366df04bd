"""Replayed decode steps on the CPU: a pure decode step's kernel calls bound once to persistent tensors,
then run as a flat list (what CUDA graphs do for vLLM's decode steps, for the C kernels' ctypes calls).

Why: with the C kernels, a small model's decode step is bound by the Python around them: each C call's
module dispatch, argument checks, stride walks, ``torch.empty`` and ctypes argument building (several times
the C call's own time for a norm), ~45 such calls a step, plus the views, splits and casts between them
(profiles: benchmarks/engine_profile*.json).

What: :class:`DecodeGraph` is built for one row count N from a :class:`~pipeline.engine.worker.runner.ModelRunner`.
It holds every activation of the step in tensors made once (the token ids, the residual stream, each
projection's output, ...) and the step as a list of ops, each a C function with its arguments (pointers
into those tensors and into the packed weights) bound once, or a torch call on those tensors (the embedding
as ``index_select``, casts, the residual adds in place). A step copies in its inputs (ids, cos / sin of
the positions, the cache slots) and passes the DecodeBatch's block table and lengths to the attention
calls; nothing else is built. Every op is the eager path's own call on the same values in the same order
(the modules' ``bind`` methods give their C calls' arguments; a module without one is called as eager
calls it, its result copied into a buffer), so logits, hidden states and the cache are bit-identical to
the eager path, which stays the reference (tests/test_decode_graph.py compares them).

Used (ModelRunner.forward) for a step whose every piece is one decode token with logits at every row, on
the ``native`` kernels backend, eager regions (not ``compile``), every module of the main layers of a type
known here (a sharded replica's modules are not: it stays eager), decode attention and the cache write in C
(the engine's kernels, pipeline.engine.config); ``decode_graph=False`` on the runner (EngineConfig.decode_graph;
``DSQUANT_DECODE_GRAPH=0`` when the engine is built) turns it off. One graph per row count
seen (at most ``max_num_seqs`` of them), made on first use. The graph keeps the tensors it points at alive;
it reads the weights as packed when it was built: :meth:`ModelRunner.drop_graphs` after changing weights.
The outputs are copies of the graph's buffers (callers keep a step's logits and hidden state past the next).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.engine.config import NATIVE
from pipeline.engine.native import cpu_attention, cpu_float, cpu_float_ffn, cpu_linear, cpu_moe
from pipeline.engine.layers import decoder
from pipeline.engine.layers.moe import Int8Expert, Int8MoE
from pipeline.engine.layers.qlinear import Int8Linear, W8A8DynamicLinear, W8A8StaticLinear
from pipeline.model.causal_lm import DecoderLayer
from pipeline.model.ffn import MLP, MoE, Router
from pipeline.model.mla import MLA
from pipeline.model.norm import RMSNorm

#: The module types (exactly these, not subclasses) a main layer may hold for its steps to be replayed
#: (anything else, e.g. a sharded replica's row-parallel linears with their collectives, keeps it eager).
KNOWN = frozenset((DecoderLayer, MLA, RMSNorm, cpu_float.NativeRMSNorm, nn.Linear, cpu_float.NativeLinear,
                   W8A8StaticLinear, W8A8DynamicLinear, MLP, MoE, Router, cpu_float.NativeRouter,
                   cpu_float_ffn.NativeFloatMLP, cpu_float_ffn.NativeFloatMoE, Int8MoE, Int8Expert, nn.ModuleList))


class GraphError(ValueError):
    """A replayed op's C call reported an error."""


def ineligible(runner) -> Optional[str]:
    """Why ``runner``'s decode steps cannot be replayed, or None."""
    if runner.ops.compiled:
        return "compiled regions"
    if runner.kernels != NATIVE:
        return f"kernels backend {runner.kernels}"
    if not (runner.attention.absorbs and runner.attention.write_c):
        return "no C decode attention / cache write here"
    model = runner.model
    if type(model.model.embed_tokens) is not nn.Embedding or model.model.embed_tokens.weight.dtype != torch.float32:
        return "not a float32 nn.Embedding"
    for i in range(runner.cfg.num_hidden_layers):
        for name, mod in model.model.layers[i].named_modules():
            if type(mod) not in KNOWN:
                return f"layer {i} {name}: {type(mod).__name__}"
    for mod in (model.model.norm, model.lm_head):
        if type(mod) not in KNOWN:
            return f"{type(mod).__name__} head"
    return None


@dataclass(frozen=True)
class _CapturedStep:
    """What the captured forward reads of the step: the buffers its rope and cache write are bound to."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor


def _copy_op(dst: torch.Tensor, fn: Callable, *args) -> Callable[[], None]:
    def run() -> None:
        dst.copy_(fn(*args))
    return run


class DecodeGraph:
    """A decode step of ``n`` rows of ``runner`` (module docstring); :meth:`run` replays it. Built by running
    the layer forward (pipeline.engine.layers.decoder.forward) with this object as its ops: each call binds
    its C function (or the module, called as eager calls it) to buffers of the step, in the forward's order."""

    def __init__(self, runner, n: int):
        self.n, self.runner = n, runner
        cfg, model = runner.cfg, runner.model
        self.calls: list[tuple[Callable, tuple, str]] = []    # (function, arguments, profile region)
        self.keep: list = []                                  # what the bound pointers point into
        self.buffers: list[torch.Tensor] = []                 # the step's activations
        self.unbound: list[str] = []                          # modules called as eager calls them
        self.step_table: tuple = (0, 0, 0)                    # this step's (table, width, lengths)
        hid = cfg.hidden_size
        self.ids, self.slots = self._new(n, dtype=torch.long), self._new(n, dtype=torch.long)
        self.cos, self.sin = self._new(1, n, cfg.qk_rope_head_dim // 2), self._new(1, n, cfg.qk_rope_head_dim // 2)
        self.h, self.x = self._new(1, n, hid), self._new(1, n, hid)   # the residual stream, its normed form
        self._spare: list[torch.Tensor] = [self._new(1, n, hid)]     # [1, n, hidden] outputs added into h
        emb = model.model.embed_tokens.weight.detach()
        self._op(torch.index_select, (emb, 0, self.ids), "model other", out=self.h[0])
        step = _CapturedStep(self.cos, self.sin, self.slots)
        for i in range(cfg.num_hidden_layers):
            h = decoder.forward(self, model.model.layers[i], runner.caches[i], self.h, step)
            assert h is self.h, "decode graph: the residual stream left its buffer"
        self.hidden = self._new(1, n, hid)
        self._norm(model.model.norm, self.h, self.hidden)
        self.logits = self._linear(model.lm_head, self.hidden, cfg.vocab_size)

    # ----- the layer forward's ops (decoder.Ops), captured -------------------------------------------
    def region(self, name: str, fn: Callable, *args):
        return fn(self, *args)

    def norm(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = self.x if x is self.h else self._new(*x.shape, dtype=x.dtype)
        self._norm(mod, x, out)
        return out

    def linear(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        n_out = mod.out_features
        out = self._hidden_out() if x.shape[:-1] + (n_out,) == self.h.shape else None
        return self._linear(mod, x, n_out, out)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = self._new(*x.shape, dtype=x.dtype)
        self._rope(x, out)
        return out

    def add(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._op(h.add_, (y,), "model other")
        if y.shape == self.h.shape and y is not self.h and y is not self.x:
            self._spare.append(y)                   # read once: free for the next [1, n, hidden] output
        return h

    def mlp(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = self._hidden_out()
        self._mlp(mod, x, out)
        return out

    def write(self, cache, step, c: torch.Tensor, k_pe: torch.Tensor) -> None:
        writes = cpu_attention.bind_write(cache, self.slots, c[0], k_pe[0])
        if writes is None:
            raise ValueError("decode graph: the cache write does not take these tensors in C")
        for fn, args, keep in writes:
            self._op(fn, args, "cache write", keep)

    def attend(self, attn, cache, step, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        n, H = self.n, attn.H
        q = self._new(n, H, attn.d_n)
        self._op(q.copy_, (q_nope[0],), "model other")
        w = self.runner.attention.weights(attn)
        o = self._new(n, H, w.w_uv_t.shape[2])
        dec = cpu_attention.bind_decode(q, q_pe[0], cache, attn.scale, w.w_uk, w.w_uv_t, o)
        if dec is None:
            raise ValueError("decode graph: the decode attention does not take these tensors in C")
        fn, head, tail, keep = dec
        self._op(lambda: fn(*head, *self.step_table, *tail), (), "attention", keep)
        return o

    def _hidden_out(self) -> torch.Tensor:
        """A [1, n, hidden] buffer for an output the residual stream adds (reused once added)."""
        return self._spare.pop() if self._spare else self._new(*self.h.shape)

    # ----- building ----------------------------------------------------------------------------------
    def _new(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer of the step, held as long as the graph (the bound ops hold only its address)."""
        t = torch.zeros(shape, dtype=dtype)
        self.buffers.append(t)
        return t

    def _op(self, fn: Callable, args: tuple, region: str, keep: tuple = (), out: Optional[torch.Tensor] = None):
        if out is not None:
            f, a = fn, args
            fn, args = (lambda: f(*a, out=out)), ()
        self.calls.append((fn, args, region))
        self.keep.append(keep)

    def _bound(self, bound: Optional[tuple], region: str) -> bool:
        if bound is None:
            return False
        fn, args, keep = bound
        self._op(fn, args, region, keep)
        return True

    def _eager(self, mod: nn.Module, x: torch.Tensor, out: torch.Tensor, region: str, name: str) -> None:
        self.unbound.append(name or type(mod).__name__)
        self._op(_copy_op(out, mod, x), (), region)

    def _norm(self, mod: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        bind = getattr(mod, "bind", None)
        if not (bind and self._bound(bind(x, out), "model other")):
            self._eager(mod, x, out, "model other", "RMSNorm")

    def _linear(self, mod: nn.Module, x: torch.Tensor, n_out: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mod``(x) into ``out`` (made here when None: x's dtype, [..., n_out])."""
        if out is None:
            out = self._new(*x.shape[:-1], n_out, dtype=x.dtype)
        if isinstance(mod, cpu_float.NativeLinear):
            bound = mod.bind(x, out)
        elif isinstance(mod, Int8Linear):
            bound = cpu_linear.bind(mod, x, out)
        else:
            bound = None
        if not self._bound(bound, "linears"):
            self._eager(mod, x, out, "linears", getattr(mod, "name", type(mod).__name__))
        return out

    def _rope(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rope = self.runner.ops.rope_fn                                  # the eager forward's
        bound = cpu_float.bind_rope(x, self.cos, self.sin, out) if rope is cpu_float.rope else None
        if not self._bound(bound, "model other"):
            self.unbound.append("rope")
            self._op(_copy_op(out, rope, x, self.cos, self.sin), (), "model other")

    def _mlp(self, mlp: nn.Module, x: torch.Tensor, t: torch.Tensor) -> None:
        """mlp(x) into t."""
        if isinstance(mlp, cpu_float_ffn.NativeFloatMLP) and self._bound(cpu_float_ffn.bind(mlp, x, t), "linears"):
            return
        if isinstance(mlp, cpu_float_ffn.NativeFloatMoE) and isinstance(mlp.gate, cpu_float.NativeRouter):
            weights, idx, load, route = self._routes(mlp, x)
            ffn = cpu_float_ffn.bind(mlp, x, t, weights, idx, load)
            if route is not None and ffn is not None:
                self._bound(route, "moe")
                self._bound(ffn, "moe")
                self._op(setattr, (mlp, "last_load", load), "moe")
                return
        if isinstance(mlp, Int8MoE) and isinstance(mlp.gate, cpu_float.NativeRouter) and self._int8_moe(mlp, x, t):
            return
        if type(mlp) is MLP:
            g = self._linear(mlp.gate_proj, x, mlp.gate_proj.out_features)
            u = self._linear(mlp.up_proj, x, mlp.up_proj.out_features)
            m = self._new(*g.shape)
            self._op(lambda: torch.mul(F.silu(g), u, out=m), (), "linears")
            self._linear(mlp.down_proj, m, t.shape[-1], t)
            return
        self._eager(mlp, x, t, "moe" if isinstance(mlp, (MoE, Int8MoE)) else "linears", type(mlp).__name__)

    def _routes(self, moe, x: torch.Tensor) -> tuple:
        """Buffers for ``moe``'s routes of x (weights, expert ids, tokens per expert) and its NativeRouter's
        bound call filling the first two (None where it would not call C)."""
        n, k = self.n, moe.gate.top_k
        weights, idx = self._new(n, k), self._new(n, k, dtype=torch.long)
        load = self._new(len(moe.experts), dtype=torch.long)
        return weights, idx, load, moe.gate.bind(x.view(n, -1), weights, idx)

    def _int8_moe(self, moe: Int8MoE, x: torch.Tensor, t: torch.Tensor) -> bool:
        """Int8MoE's C path (cpu_moe) into t: the router, the routed experts' C calls, the shared expert's
        linears and SiLU, the sum; False (nothing added) where it would not run so."""
        n = self.n
        flat, out = x.view(n, -1), t.view(n, -1)
        weights, idx, load, route = self._routes(moe, x)
        routed = cpu_moe.bind_routed(moe, flat, weights, idx, out, load)
        if route is None or routed is None:
            return False
        self._bound(route, "moe")
        for op in routed:
            self._bound(op, "moe")
        self._op(setattr, (moe, "last_load", load), "moe")
        sh = moe.shared_experts
        if sh is not None:                      # out + shared_forward(shared, flat), as Int8MoE.forward
            gu = self._linear(sh.gate_up, flat, 2 * sh.inter)
            m = self._new(n, sh.inter)
            self._op(lambda: torch.mul(F.silu(gu[:, :sh.inter]), gu[:, sh.inter:], out=m), (), "moe")
            self._op(out.add_, (self._linear(sh.down_proj, m, out.shape[1]),), "moe")
        return True

    # ----- running -----------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, ids, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, batch,
            timer: Optional[Callable[[str, float], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: token ``ids`` (n ints), (cos, sin) [1, n, d_r/2] and cache ``slots`` [n] of their
        positions, ``batch`` their DecodeBatch -> (logits [n, V], final normed hidden [n, hidden]), copies
        of the graph's buffers. ``timer(region, seconds)``: each op's time (a profiler's; slower)."""
        self.ids.copy_(torch.as_tensor(ids))
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.slots.copy_(slots)
        table, lengths = batch.table, batch.lengths      # (held by the caller's batch during the step)
        self.step_table = (table.data_ptr(), table.shape[1], lengths.data_ptr())
        if timer is None:
            for i, (fn, args, _) in enumerate(self.calls):
                rc = fn(*args)
                if rc.__class__ is int and rc:
                    self._fail(i, rc)
        else:
            for i, (fn, args, region) in enumerate(self.calls):
                t0 = time.perf_counter()
                rc = fn(*args)
                timer(region, time.perf_counter() - t0)
                if rc.__class__ is int and rc:
                    self._fail(i, rc)
        return self.logits[0].clone(), self.hidden[0].clone()     # callers keep them past the next step

    def _fail(self, i: int, rc: int) -> None:
        fn, _, region = self.calls[i]
        raise GraphError(f"decode graph ({self.n} rows): op {i} ({getattr(fn, '__name__', fn)!r}, {region}) "
                         f"returned {rc}")
