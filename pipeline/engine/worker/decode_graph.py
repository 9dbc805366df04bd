"""Replayed decode steps on the CPU: a pure decode step's kernel calls bound once to persistent tensors,
then run as a flat list (what CUDA graphs do for vLLM's decode steps, for the C kernels' ctypes calls).

Why: with the C kernels, a small model's decode step was bound by the Python around them. Measured on the
embedded model (an AVX2 EPYC, one thread), a 16-row decode step took ~6 ms, of which py-spy put ~45% outside
the kernels: each C call's module dispatch, argument checks, stride walks, ``torch.empty`` and ctypes
argument building (a NativeRMSNorm call: ~21 us, ~3 of them in C), ~45 such calls a step, plus the views,
splits and casts between them.

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
known here (a sharded replica's modules are not: it stays eager), decode attention in C; ``decode_graph=False``
on the runner (EngineConfig.decode_graph) or ``DSQUANT_DECODE_GRAPH=0`` turns it off. One graph per row count
seen (at most ``max_num_seqs`` of them), made on first use. The graph keeps the tensors it points at alive;
it reads the weights as packed when it was built: :meth:`ModelRunner.drop_graphs` after changing weights.
The outputs are copies of the graph's buffers (callers keep a step's logits and hidden state past the next).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.cbuild import _getenv
from pipeline.engine.native import cpu_attention, cpu_float, cpu_float_ffn, cpu_linear, cpu_moe
from pipeline.engine.layers.moe import Int8Expert, Int8MoE
from pipeline.engine.layers.qlinear import Int8Linear, W8A8DynamicLinear, W8A8StaticLinear
from pipeline.model.causal_lm import DecoderLayer
from pipeline.model.ffn import MLP, MoE, Router
from pipeline.model.mla import MLA
from pipeline.model.norm import RMSNorm
from pipeline.model.rope import apply_rope

SWITCH = "DSQUANT_DECODE_GRAPH"           # 0: every step eager
#: The module types (exactly these, not subclasses) a main layer may hold for its steps to be replayed
#: (anything else, e.g. a sharded replica's row-parallel linears with their collectives, keeps it eager).
KNOWN = frozenset((DecoderLayer, MLA, RMSNorm, cpu_float.NativeRMSNorm, nn.Linear, cpu_float.NativeLinear,
                   W8A8StaticLinear, W8A8DynamicLinear, MLP, MoE, Router, cpu_float.NativeRouter,
                   cpu_float_ffn.NativeFloatMLP, cpu_float_ffn.NativeFloatMoE, Int8MoE, Int8Expert, nn.ModuleList))


class GraphError(ValueError):
    """A replayed op's C call reported an error."""


#: The environment variables the eager path's kernel choices read per call: a graph is made again when one
#: changes (and none is used while DSQUANT_DECODE_GRAPH=0), or torch's thread count (the int8 linears'
#: ``auto`` choice reads it).
WATCHED = (SWITCH, "DSQUANT_NATIVE", "DSQUANT_NATIVE_FLOAT", "DSQUANT_NATIVE_LINEAR", "DSQUANT_KERNELS")


def switches() -> tuple:
    """The values of :data:`WATCHED` now, and torch's intra-op thread count."""
    return tuple(_getenv(v) for v in WATCHED) + (torch.get_num_threads(),)


def ineligible(runner) -> Optional[str]:
    """Why ``runner``'s decode steps cannot be replayed, or None."""
    from pipeline.engine.worker.kernels import NATIVE

    if runner.regions.compiled:
        return "compiled regions"
    if runner.kernels != NATIVE:
        return f"kernels backend {runner.kernels}"
    if cpu_attention.serving_library() is None or cpu_attention.write_library() is None:
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


def _copy_op(dst: torch.Tensor, fn: Callable, *args) -> Callable[[], None]:
    def run() -> None:
        dst.copy_(fn(*args))
    return run


class DecodeGraph:
    """A decode step of ``n`` rows of ``runner`` (module docstring); :meth:`run` replays it."""

    def __init__(self, runner, n: int):
        self.n, self.runner = n, runner
        cfg, model = runner.cfg, runner.model
        self.ops: list[tuple[Callable, tuple, str]] = []      # (function, arguments, profile region)
        self.keep: list = []                                  # what the bound pointers point into
        self.buffers: list[torch.Tensor] = []                 # the step's activations
        self.unbound: list[str] = []                          # modules called as eager calls them
        self.step_table: tuple = (0, 0, 0)                    # this step's (table, width, lengths)
        hid = cfg.hidden_size
        self.ids, self.slots = self._new(n, dtype=torch.long), self._new(n, dtype=torch.long)
        self.cos, self.sin = self._new(1, n, cfg.qk_rope_head_dim // 2), self._new(1, n, cfg.qk_rope_head_dim // 2)
        self.h, self.x, self.t = self._new(1, n, hid), self._new(1, n, hid), self._new(1, n, hid)
        emb = model.model.embed_tokens.weight.detach()
        self._op(torch.index_select, (emb, 0, self.ids), "model other", out=self.h[0])
        for i in range(cfg.num_hidden_layers):
            self._layer(model.model.layers[i], runner.caches[i])
        self.hidden = self._new(1, n, hid)
        self._norm(model.model.norm, self.h, self.hidden)
        self.logits = self._linear(model.lm_head, self.hidden, cfg.vocab_size)

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
        self.ops.append((fn, args, region))
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
        rope = getattr(self.runner.regions.attn_in, "keywords", {}).get("rope", apply_rope)   # eager attn_in's
        bound = cpu_float.bind_rope(x, self.cos, self.sin, out) if rope is cpu_float.rope else None
        if not self._bound(bound, "model other"):
            self.unbound.append("rope")
            self._op(_copy_op(out, rope, x, self.cos, self.sin), (), "model other")

    def _layer(self, layer, cache) -> None:
        attn, n = layer.self_attn, self.n
        H, d_n, d_r, C = attn.H, attn.d_n, attn.d_r, attn.C
        self._norm(layer.input_layernorm, self.h, self.x)
        if hasattr(attn, "q_a_proj"):
            qa = self._linear(attn.q_a_proj, self.x, attn.q_a_proj.out_features)
            qan = self._new(*qa.shape)
            self._norm(attn.q_a_layernorm, qa, qan)
            q = self._linear(attn.q_b_proj, qan, attn.q_b_proj.out_features)
        else:
            q = self._linear(attn.q_proj, self.x, attn.q_proj.out_features)
        q4 = q.view(1, n, H, d_n + d_r)
        q_pe = self._new(1, n, H, d_r)
        self._rope(q4[..., d_n:], q_pe)
        kv = self._linear(attn.kv_a_proj_with_mqa, self.x, C + d_r)
        c, k_pe = self._new(1, n, C), self._new(1, n, d_r)
        self._norm(attn.kv_a_layernorm, kv[..., :C], c)
        self._rope(kv[..., C:], k_pe)
        q_nope = self._new(n, H, d_n)
        self._op(q_nope.copy_, (q4[0, :, :, :d_n],), "model other")
        writes = cpu_attention.bind_write(cache, self.slots, c[0], k_pe[0])
        w_uk, w_uv_t = self.runner._absorbed(attn)[:2]
        o = self._new(n, H, w_uv_t.shape[2])
        dec = cpu_attention.bind_decode(q_nope, q_pe[0], cache, attn.scale, w_uk, w_uv_t, o)
        if writes is None or dec is None:
            raise ValueError("decode graph: the cache write / decode attention do not take these tensors in C")
        for fn, args, keep in writes:
            self._op(fn, args, "cache write", keep)
        fn, head, tail, keep = dec
        self._op(lambda: fn(*head, *self.step_table, *tail), (), "attention", keep)
        self._linear(attn.o_proj, o.view(1, n, -1), self.t.shape[-1], self.t)
        self._op(self.h.add_, (self.t,), "model other")
        self._norm(layer.post_attention_layernorm, self.h, self.x)
        self._mlp(layer.mlp)
        self._op(self.h.add_, (self.t,), "model other")

    def _mlp(self, mlp: nn.Module) -> None:
        """layer.mlp(x) into t."""
        x, t = self.x, self.t
        if isinstance(mlp, cpu_float_ffn.NativeFloatMLP) and self._bound(cpu_float_ffn.bind(mlp, x, t), "linears"):
            return
        if isinstance(mlp, cpu_float_ffn.NativeFloatMoE) and isinstance(mlp.gate, cpu_float.NativeRouter):
            weights, idx, load, route = self._routes(mlp)
            ffn = cpu_float_ffn.bind(mlp, x, t, weights, idx, load)
            if route is not None and ffn is not None:
                self._bound(route, "moe")
                self._bound(ffn, "moe")
                self._op(setattr, (mlp, "last_load", load), "moe")
                return
        if isinstance(mlp, Int8MoE) and isinstance(mlp.gate, cpu_float.NativeRouter) and self._int8_moe(mlp):
            return
        if type(mlp) is MLP:
            g = self._linear(mlp.gate_proj, x, mlp.gate_proj.out_features)
            u = self._linear(mlp.up_proj, x, mlp.up_proj.out_features)
            m = self._new(*g.shape)
            self._op(lambda: torch.mul(F.silu(g), u, out=m), (), "linears")
            self._linear(mlp.down_proj, m, t.shape[-1], t)
            return
        self._eager(mlp, x, t, "moe" if isinstance(mlp, (MoE, Int8MoE)) else "linears", type(mlp).__name__)

    def _routes(self, moe) -> tuple:
        """Buffers for ``moe``'s routes of x (weights, expert ids, tokens per expert) and its NativeRouter's
        bound call filling the first two (None where it would not call C)."""
        n, k = self.n, moe.gate.top_k
        weights, idx = self._new(n, k), self._new(n, k, dtype=torch.long)
        load = self._new(len(moe.experts), dtype=torch.long)
        return weights, idx, load, moe.gate.bind(self.x.view(n, -1), weights, idx)

    def _int8_moe(self, moe: Int8MoE) -> bool:
        """Int8MoE's C path (cpu_moe) into t: the router, the routed experts' C calls, the shared expert's
        linears and SiLU, the sum; False (nothing added) where it would not run so."""
        n = self.n
        flat, out = self.x.view(n, -1), self.t.view(n, -1)
        weights, idx, load, route = self._routes(moe)
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
            for i, (fn, args, _) in enumerate(self.ops):
                rc = fn(*args)
                if rc.__class__ is int and rc:
                    self._fail(i, rc)
        else:
            for i, (fn, args, region) in enumerate(self.ops):
                t0 = time.perf_counter()
                rc = fn(*args)
                timer(region, time.perf_counter() - t0)
                if rc.__class__ is int and rc:
                    self._fail(i, rc)
        return self.logits[0].clone(), self.hidden[0].clone()     # callers keep them past the next step

    def _fail(self, i: int, rc: int) -> None:
        fn, _, region = self.ops[i]
        raise GraphError(f"decode graph ({self.n} rows): op {i} ({getattr(fn, '__name__', fn)!r}, {region}) "
                         f"returned {rc}")
