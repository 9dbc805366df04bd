"""The routed experts of an :class:`pipeline.engine.layers.moe.Int8MoE` on the CPU for all tokens at once, in two
C calls (csrc/int8_linear_cpu.c) around torch's SiLU:

1. ``moe_gate_up``: quantize every token once per token (qlinear.quantize_per_token's float32 ops), sort the
   (token, k) slots by expert (a stable counting sort: ``argsort(stable=True)``'s order), and for each
   expert with tokens one int8 GEMM of its tokens' rows against its stacked gate+up weight [2I, H] with
   the dynamic epilogue (``exact`` or ``fast``, as the linears): ``gu`` float32 [slots, 2I] in slot order,
   and the tokens per expert (``last_load``);
2. torch: ``h = silu(gu[:, :I].to(dtype)) * gu[:, I:].to(dtype)``, the ops Int8Expert runs on the same
   rows (same strides, so the same vectorized lanes);
3. ``moe_down``: per slot row, the down projection's per-token quantization, the GEMM, the epilogue, the
   cast to ``dtype`` and back, times the slot's router weight, added into the token's float32 output in
   slot order: index_add_'s additions in ``combine_experts``'s order, starting from 0.

Each step computes the same float32 operations in the same order as Int8MoE's torch path, so the output
(and ``last_load``) equals it bit for bit (tests/test_native_moe.py). One caveat is torch's own: its SiLU
takes Sleef's vectorized exp for full vector lanes and std::exp for a tail, and splits tensors of more than
32768 elements over threads, so on both paths the lanes (and the last bit of an output) can move with
the row grouping only for such large prefill batches with several intra-op threads.

The shared expert runs through the fused linears (cpu_linear): gate+up of the float rows (quantized in
C, the same int8 as quantize_per_token), the same SiLU, down.

The experts are packed once per module (:class:`PackedExperts`, the C kernel's layout) on first use and
again after ``load_state_dict`` or ``.to()`` on the MoE (Int8MoE drops the pack: :func:`drop_pack`);
in-place edits of single expert tensors are not watched (as ``kernels.moe_gemm.StackedExperts``): call
:func:`drop_pack` after one. Packed on first use they hold the int8 weights a second time; :func:`compact`
(what an engine's loader does) packs them at once and makes the stacked pack every expert linear's only
copy (each a compact cpu_linear module over its slice: cpu_linear's docstring).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.engine.native import cpu_linear, hugepages
from pipeline.format.description import W8A8_DYNAMIC

#: The Int8Linear kernels (layers.qlinear's) that let the C path serve a linear.
C_KERNELS = ("auto", "native")

p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class MoEParams(ctypes.Structure):
    """csrc/int8_linear_cpu.c's ``moe_t``."""
    _fields_ = [("E", i64), ("H", i64), ("I", i64), ("gu_np", i64), ("gu_kp", i64), ("dn_np", i64),
                ("dn_kp", i64), ("gu_pack", p), ("gu_sum", p), ("gu_scale", p), ("dn_pack", p), ("dn_sum", p),
                ("dn_scale", p), ("epilogue", i32)]


class PackedExperts:
    """Every routed expert's gate+up and down weights in the C layout, stacked, with float32 scales."""

    def __init__(self, moe, compact: bool = False):
        ex = list(moe.experts)
        I, H, E = ex[0].inter, ex[0].gate_up.in_features, len(ex)
        gu_np, gu_kp = cpu_linear.padded(2 * I, H)
        dn_np, dn_kp = cpu_linear.padded(H, I)
        # each expert packed straight into its slice of the stacked (huge-page backed) buffers: no second copy
        gu_pack, dn_pack = hugepages.empty((E, gu_np * gu_kp), torch.int8), hugepages.empty((E, dn_np * dn_kp), torch.int8)
        gu_sum, dn_sum = torch.empty(E, gu_np, dtype=torch.int32), torch.empty(E, dn_np, dtype=torch.int32)
        for i, e in enumerate(ex):
            for lin, pack, wsum in ((e.gate_up, gu_pack[i], gu_sum[i]), (e.down_proj, dn_pack[i], dn_sum[i])):
                if compact:                   # the slice becomes the linear's own (and only) packed copy
                    cpu_linear.compact(lin, cpu_linear.Packed(lin, pack, wsum))
                else:
                    cpu_linear.pack_weight(lin.int8_weight(), pack, wsum)
        self.keep = [gu_pack, gu_sum, dn_pack, dn_sum,
                     torch.cat([e.gate_up.weight_scale.float().reshape(-1) for e in ex]),
                     torch.cat([e.down_proj.weight_scale.float().reshape(-1) for e in ex])]
        ptr = [t.data_ptr() for t in self.keep]
        self.params = MoEParams(len(ex), H, I, gu_np, gu_kp, dn_np, dn_kp, ptr[0], ptr[1], ptr[4], ptr[2], ptr[3],
                                ptr[5], cpu_linear.EPILOGUES[ex[0].gate_up.epilogue])
        self.ref = ctypes.addressof(self.params)
        self.E, self.H, self.I = len(ex), H, I


def supported(moe) -> bool:
    """Whether the C path can run ``moe``'s routed experts: plain W8A8_DYNAMIC down projections (not a
    sharded wrapper), one expert shape, kernel ``auto`` or ``native``, k within the exact range."""
    ex = list(moe.experts)
    if not ex:
        return False
    I, H = ex[0].inter, ex[0].gate_up.in_features
    return all(getattr(e.down_proj, "kind", None) == W8A8_DYNAMIC and e.inter == I and e.gate_up.in_features == H
               and (e.down_proj.out_features, e.down_proj.in_features) == (H, I) and e.gate_up.kernel in C_KERNELS
               and e.down_proj.kernel in C_KERNELS for e in ex) and max(H, I) <= cpu_linear.MAX_K


def packed(moe) -> PackedExperts:
    pk = moe.__dict__.get("_native_experts")
    if pk is None:
        pk = moe.__dict__["_native_experts"] = PackedExperts(moe)
    return pk


def compact(moe) -> bool:
    """Pack ``moe``'s routed experts now, the stacked pack their only copy (module docstring); False (nothing
    done) where the C path cannot run them."""
    if not supported(moe):
        return False
    if not all(cpu_linear.is_compact(lin) for e in moe.experts for lin in (e.gate_up, e.down_proj)):
        moe.__dict__["_native_experts"] = PackedExperts(moe, compact=True)
    return True


def drop_pack(module, incompatible_keys=None) -> None:
    """Forget the packed experts (also a load_state_dict post hook): the next forward packs them again."""
    module.__dict__.pop("_native_experts", None)
    module.__dict__.pop("_native_ok", None)


def routed(moe, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed experts' weighted sum for tokens ``flat`` [N, H] (float32 / bf16) routed to ``idx``
    [N, top_k] with ``weights`` [N, top_k]: (float32 [N, H], tokens per expert int64 [E]) -- what
    ``combine_experts`` returns for Int8MoE's experts."""
    pk, lib = packed(moe), cpu_linear.loaded()
    dt = cpu_linear.DTYPES[flat.dtype]
    N, top_k = idx.shape
    if flat.shape != (N, pk.H):
        raise ValueError(f"MoE: tokens {list(flat.shape)} do not fit the experts' hidden size {pk.H} and {N} routes")
    flat, idx = flat.contiguous(), idx.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    S = N * top_k
    order, load = torch.empty(S, dtype=torch.int64), torch.empty(pk.E, dtype=torch.int64)
    gu = torch.empty(S, 2 * pk.I, dtype=torch.float32)
    rc = lib.moe_gate_up(pk.ref, flat.data_ptr(), dt, N, top_k, idx.data_ptr(), order.data_ptr(),
                         load.data_ptr(), gu.data_ptr())
    if rc == -2:
        raise ValueError(f"MoE: router expert ids outside [0, {pk.E}) (min {int(idx.min())}, max {int(idx.max())})")
    cpu_linear._check(rc, "MoE gate/up")
    h = F.silu(gu[:, :pk.I].to(flat.dtype)) * gu[:, pk.I:].to(flat.dtype)
    out = torch.empty(N, pk.H, dtype=torch.float32)
    cpu_linear._check(lib.moe_down(pk.ref, h.data_ptr(), dt, N, top_k, order.data_ptr(), load.data_ptr(),
                                   weights.data_ptr(), out.data_ptr()), "MoE down")
    return out, load


def bind_routed(moe, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
                load: torch.Tensor) -> Optional[list]:
    """:func:`routed` as a list of (function, arguments, tensors to hold) for the tensors' current storage
    (pipeline.engine.worker.decode_graph): contiguous float32 ``flat`` [N, H], the routes ``weights`` float32 /
    ``idx`` int64 [N, top_k], into ``out`` float32 [N, H] and ``load`` int64 [E]; the two C calls and torch's
    SiLU between them on buffers made here. None where routed would not run on these tensors."""
    if not can_run(moe, flat) or flat.dtype != torch.float32 or flat.dim() != 2 or not flat.is_contiguous():
        return None
    pk, lib = packed(moe), cpu_linear.loaded()
    N, top_k = idx.shape
    if flat.shape != (N, pk.H) or weights.shape != idx.shape or weights.dtype != torch.float32 \
            or idx.dtype != torch.int64 or out.shape != (N, pk.H) or out.dtype != torch.float32 \
            or load.shape != (pk.E,) or load.dtype != torch.int64 \
            or not all(t.is_contiguous() for t in (weights, idx, out, load)):
        return None
    S, dt = N * top_k, cpu_linear.DTYPES[flat.dtype]
    order = torch.zeros(S, dtype=torch.int64)
    gu = torch.zeros(S, 2 * pk.I, dtype=torch.float32)
    h = torch.zeros(S, pk.I, dtype=torch.float32)
    g, u = gu[:, :pk.I], gu[:, pk.I:]
    keep = (pk, order, gu, h)
    return [(lib.moe_gate_up, (pk.ref, flat.data_ptr(), dt, N, top_k, idx.data_ptr(), order.data_ptr(),
                               load.data_ptr(), gu.data_ptr()), keep),
            (lambda: torch.mul(F.silu(g), u, out=h), (), ()),
            (lib.moe_down, (pk.ref, h.data_ptr(), dt, N, top_k, order.data_ptr(), load.data_ptr(),
                            weights.data_ptr(), out.data_ptr()), ())]


def shared_forward(expert, flat: torch.Tensor) -> torch.Tensor:
    """An Int8Expert on float rows through the fused linears: ``forward_quantized(*quantize_per_token(flat),
    flat.dtype)`` bit for bit (gate+up has no bias, so its output in flat's dtype is the float32 epilogue
    cast as forward_quantized casts it)."""
    gu = expert.gate_up(flat)
    return expert.down_proj(F.silu(gu[:, :expert.inter]) * gu[:, expert.inter:])


def can_run(moe, x: torch.Tensor) -> bool:
    """The C path for this call: float32 / bf16 CPU input, the module's C kernels on (``moe.native``,
    chosen when it was built), a supported MoE (checked once per module)."""
    if x.dtype not in cpu_linear.DTYPES or not moe.native or x.device.type != "cpu":
        return False
    ok: Optional[bool] = moe.__dict__.get("_native_ok")
    if ok is None:
        ok = moe.__dict__["_native_ok"] = supported(moe)
    return ok
