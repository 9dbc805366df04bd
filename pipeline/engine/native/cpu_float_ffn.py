"""The float model's feed-forward blocks on the CPU, each in one C call (csrc/float_ffn_cpu.c), swapped in
by :func:`pipeline.engine.layers.native_swap.use_native_float_ops` for a float model (never a quantized model's:
its MoEs are Int8MoE, and its float MTP layer stays torch) where the kernels backend is ``native``:

- :class:`NativeFloatMoE` for a ``MoE``: the same router, experts and shared expert modules (the same state
  dict and ``last_load``); forward: the router (a NativeRouter after the swap), then one ``float_ffn``
  call: the (token, k) slots sorted by expert (stable, as combine_experts), per expert one GEMM of its
  tokens' rows against its stacked gate+up weight [2I, H] from the bf16 bits, ``silu(gate) * up`` in
  float32 (F.silu's formula ``g / (1 + exp(-g))``, then the product, as MLP.forward), one GEMM against
  the down weight, the weighted sum added into each token's float32 output in combine_experts' order
  (index_add_'s two roundings, from 0), and last the shared expert of every row added (``out + shared``);
- :class:`NativeFloatMLP` for a dense ``MLP`` (up to FFN_C_ROWS rows; more: MLP.forward): the same expert
  arithmetic on all rows.

Exactness: the weights are bf16 values widened (exact), so every product is the float32 model's; the GEMMs
sum in another order than torch's (csrc/bf16_gemm.h: one sequential FMA chain per output, or on an AMX CPU
the tiles) and the SiLU's exp (csrc/vexp.h with AVX-512, else libm's expf) may differ from torch's
vectorized exp by an ulp or two, so outputs agree with the torch modules within float32
rounding (tests/test_native_float_moe.py states the tolerance), the routing being the router's. A token's
output never depends on the other tokens of the call.

The weights are packed once per module on first use (:class:`PackedFFN`: their bf16 bits, half the
float32 bytes, a second copy) and again after ``load_state_dict`` or ``.to()``; a bf16 checkpoint's are
packed at load straight from the stored bits (:func:`bits_mlps`: pipeline.engine.worker.float_bits), the
linears compact cpu_float.NativeLinears over their slots of the stacks, the only copy; in-place edits of single
weight tensors are not watched (as cpu_moe's int8 pack): call :func:`drop_pack` after one. Anything the C
code does not take (another dtype or device, autograd, torch.compile tracing, weights no longer of bf16
values, the library off: ``DSQUANT_NATIVE=0`` or ``DSQUANT_NATIVE_FLOAT=0``) runs the torch module's own
forward, the reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from pipeline.cbuild import EXACT_FLAGS, NativeLibrary
from pipeline.engine.native import hugepages
from pipeline.engine.native.bf16_pack import bf16_representable, pack_bf16, packed_shape
from pipeline.engine.native.cpu_float import NativeLinear
from pipeline.model.ffn import MLP, MoE

CSRC = Path(__file__).with_name("csrc")
SWITCH = "DSQUANT_NATIVE_FLOAT"             # the float ops' switch (cpu_float.SWITCH)
_ERRORS = {1: "out of memory", 2: "bad sizes"}
#: Above this many rows a dense MLP runs MLP.forward (MKL's GEMMs); the MoE has no such limit (its torch
#: path is a Python loop over experts: slower at every size measured); the dense MLP's C call is faster
#: than MKL's GEMMs at decode and prefill-chunk sizes and about even from a few hundred rows
#: (benchmarks/cpu_float.json). 2048 = a served engine's max_batched_tokens (cpu_float.LINEAR_C_ROWS: the same reasoning).
FFN_C_ROWS = 2048


class FFNParams(ctypes.Structure):
    """csrc/float_ffn_cpu.c's ``float_ffn_t``."""
    _fields_ = [("E", ctypes.c_int64), ("H", ctypes.c_int64), ("I", ctypes.c_int64), ("Is", ctypes.c_int64),
                ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p), ("s_gate_up", ctypes.c_void_p),
                ("s_down", ctypes.c_void_p)]


def _declare(dll: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dll.float_ffn.argtypes = [p, p, i64, i64, i64, p, p, p, p]
    dll.float_ffn.restype = ctypes.c_int


_LIB = NativeLibrary(CSRC / "float_ffn_cpu.c", _declare, EXACT_FLAGS, switch=SWITCH,
                     what="native float MLP / MoE (torch's modules give the same within float32 rounding)")


def library() -> Optional[ctypes.CDLL]:
    return _LIB.library()


def status() -> str:
    return f"float FFN: {_LIB.status()}"


def reset() -> None:
    _LIB.reset()


def plain_mlp(mlp: Optional[nn.Module], shape: Optional[tuple[int, int]] = None) -> bool:
    """An ``MLP`` whose three linears are bias-free float32 CPU ``nn.Linear`` weights of bf16 values, or
    compact NativeLinears (their bf16 bits) (gate, up [I, H], down [H, I]; ``shape`` (I, H) when given)."""
    if not isinstance(mlp, MLP):
        return False
    lins = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(isinstance(m, nn.Linear) and m.bias is None for m in lins):
        return False
    I, H = shape or (mlp.gate_proj.out_features, mlp.gate_proj.in_features)
    return all(_bf16_linear(m, s) for m, s in zip(lins, ((I, H), (I, H), (H, I))))


def _bf16_linear(m: nn.Linear, shape: tuple[int, int]) -> bool:
    if isinstance(m, NativeLinear) and m.is_compact():     # its bits: bf16 values, read back on demand
        return (m.out_features, m.in_features) == shape
    w = m.weight.detach()
    return w.dtype == torch.float32 and w.device.type == "cpu" and tuple(w.shape) == shape and bf16_representable(w)


def supported(moe: MoE) -> bool:
    """Whether the C path can run ``moe``'s routed experts: plain MLPs (:func:`plain_mlp`) of one shape."""
    ex = list(moe.experts)
    return bool(ex) and type(ex[0]) is MLP \
        and all(plain_mlp(e, (ex[0].gate_proj.out_features, ex[0].gate_proj.in_features)) for e in ex)


def _pack_mlp(mlps: Sequence[MLP], names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        gu = torch.stack([pack_bf16(torch.cat([e.gate_proj.weight, e.up_proj.weight]), f"{n}gate_proj+up_proj")
                          for e, n in zip(mlps, names)])
        dn = torch.stack([pack_bf16(e.down_proj.weight, f"{n}down_proj") for e, n in zip(mlps, names)])
    return gu, dn


def bits_mlps(mlps: Sequence[MLP], weights: list[Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
              names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Give ``mlps`` (MLPs of one shape, e.g. a MoE's experts still on the meta device) the bf16 (gate, up,
    down) ``weights`` as a checkpoint stores them, packed straight into the stacks the C call reads (gate+up
    [E, 2I, H] and down [E, H, I], :class:`PackedFFN`'s layout) and never widened: each linear a compact
    cpu_float.NativeLinear whose bits are its slot of a stack (gate's and up's bits are the two halves of
    their stacked pack when I is a multiple of 16: :func:`stackable`), so the stacks are the only copy.
    Each entry of ``weights`` is let go (None) once packed, so that its stored tensors can be freed then.
    Returns the stacks (PackedFFN's ``stacks``)."""
    I, H = weights[0][0].shape
    if not stackable(I):
        raise ValueError(f"{names[0]}: an MLP of {I} intermediate columns is not stacked from its parts' bits")
    gu = hugepages.empty((len(mlps), *packed_shape(2 * I, H)), torch.int32)
    dn = hugepages.empty((len(mlps), *packed_shape(H, I)), torch.int32)
    half = I // 16
    for e, (mlp, name) in enumerate(zip(mlps, names)):
        (g, u, d), weights[e] = weights[e], None
        mlp.gate_proj = NativeLinear.from_bits(pack_bf16(g, f"{name}gate_proj.weight", gu[e, :half]), (I, H))
        mlp.up_proj = NativeLinear.from_bits(pack_bf16(u, f"{name}up_proj.weight", gu[e, half:]), (I, H))
        mlp.down_proj = NativeLinear.from_bits(pack_bf16(d, f"{name}down_proj.weight", dn[e]), (H, I))
    return gu, dn


def stackable(inter: int) -> bool:
    """Whether :func:`bits_mlps` takes MLPs of ``inter`` intermediate columns: gate's and up's packs are then
    the two halves of their stack's (whole blocks of 16 rows each)."""
    return inter % 16 == 0


class PackedFFN:
    """Routed experts (stacked gate+up [2I, H] and down [H, I] per expert) and a shared / dense MLP, packed
    (bf16_pack); ``ref``: the C struct's address."""

    def __init__(self, experts: Sequence[MLP], shared: Optional[MLP], shared_name: str = "shared_experts.",
                 stacks: tuple = (None, None)):
        """``stacks``: the experts' and the shared MLP's packs already made (:func:`bits_mlps`'s, or None
        for one to pack here), taken as they are."""
        self.E, self.I, self.Is = len(experts), 0, 0
        gu = dn = s_gu = s_dn = None
        if experts:
            self.I, self.H = experts[0].gate_proj.out_features, experts[0].gate_proj.in_features
            gu, dn = stacks[0] or _pack_mlp(experts, [f"experts.{i}." for i in range(self.E)])
        if shared is not None:
            self.Is, self.H = shared.gate_proj.out_features, shared.gate_proj.in_features
            s_gu, s_dn = stacks[1] or _pack_mlp([shared], [shared_name])
        self.keep = (gu, dn, s_gu, s_dn)
        self.params = FFNParams(self.E, self.H, self.I, self.Is,
                                *(None if t is None else t.data_ptr() for t in self.keep))
        self.ref = ctypes.addressof(self.params)


def drop_pack(module, incompatible_keys=None) -> None:
    """Forget the packed weights (also a load_state_dict post hook): the next forward packs them again."""
    module.__dict__.pop("_packed_ffn", None)


class _Packs:
    """The pack's life cycle for NativeFloatMoE / NativeFloatMLP: dropped on ``.to()`` (new tensors) and
    left out of copies and pickles (it holds C pointers; the copy packs its own on first use)."""

    def _apply(self, fn, recurse=True):
        drop_pack(self)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_packed_ffn", None)
        return state


def _run(pk: PackedFFN, flat: torch.Tensor, weights: Optional[torch.Tensor] = None,
         idx: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The C call on float32 rows ``flat`` [N, H]: (out float32 [N, H], tokens per expert int64 [E] or None)."""
    N = flat.shape[0]
    if flat.stride(-1) != 1 or (N > 1 and flat.stride(0) < pk.H):
        flat = flat.contiguous()
    out = torch.empty(N, pk.H, dtype=torch.float32)
    load = None
    if pk.E:
        if weights is None or idx is None or idx.dim() != 2 or idx.shape[0] != N or weights.shape != idx.shape:
            raise ValueError(f"MoE: routes idx {None if idx is None else list(idx.shape)} / weights "
                             f"{None if weights is None else list(weights.shape)} do not fit {N} tokens")
        idx, weights = idx.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()
        load = torch.empty(pk.E, dtype=torch.int64)
    rc = _LIB.loaded().float_ffn(*_ffn_args(pk, flat, out, weights, idx, load))
    if rc == 3:
        raise ValueError(f"MoE: router expert ids outside [0, {pk.E}) (min {int(idx.min())}, max {int(idx.max())})")
    if rc:
        raise ValueError(f"native float FFN: {_ERRORS.get(rc, f'error {rc}')}")
    return out, load


def _ffn_args(pk: PackedFFN, flat: torch.Tensor, out: torch.Tensor, weights: Optional[torch.Tensor],
              idx: Optional[torch.Tensor], load: Optional[torch.Tensor]) -> tuple:
    N = flat.shape[0]
    return (pk.ref, flat.data_ptr(), N, flat.stride(0) if N > 1 else pk.H, 1 if idx is None else idx.shape[1],
            None if idx is None else idx.data_ptr(), None if weights is None else weights.data_ptr(),
            None if load is None else load.data_ptr(), out.data_ptr())


def bind(module, x: torch.Tensor, out: torch.Tensor, weights: Optional[torch.Tensor] = None,
         idx: Optional[torch.Tensor] = None, load: Optional[torch.Tensor] = None) -> Optional[tuple]:
    """(C function, arguments, the pack to hold) computing a NativeFloatMLP's forward of ``x`` [1, N, H] (a
    NativeFloatMoE's: with the routes ``weights`` / ``idx`` [N, top_k] its router gives, int64 ``load``
    [E]) into ``out`` (contiguous float32, x's shape), for the tensors' current storage
    (pipeline.engine.worker.decode_graph); None where forward would not make this one C call."""
    moe = isinstance(module, NativeFloatMoE)
    if not isinstance(module, (NativeFloatMoE, NativeFloatMLP)) or x.dtype != torch.float32 or not x.is_cpu \
            or not x.is_contiguous() or not out.is_contiguous() or out.shape != x.shape or out.dtype != torch.float32 \
            or _LIB.loaded() is None:
        return None
    pk = module.packed()
    if pk is None or x.shape[-1] != pk.H or (not moe and x.numel() > FFN_C_ROWS * pk.H):
        return None
    if moe:
        N = x.numel() // pk.H
        if (module.shared_experts is not None and not pk.Is) or idx is None or weights is None or load is None \
                or idx.shape != (N, idx.shape[1]) or weights.shape != idx.shape or idx.dtype != torch.int64 \
                or weights.dtype != torch.float32 or load.shape != (pk.E,) or load.dtype != torch.int64 \
                or not (idx.is_contiguous() and weights.is_contiguous()):
            return None
    flat = x.view(-1, pk.H)
    return _LIB.loaded().float_ffn, _ffn_args(pk, flat, out, weights, idx, load), (pk,)


def _c_input(x: torch.Tensor, params) -> bool:
    """float32 CPU input, no autograd to record, not being traced, the library on."""
    return x.dtype == torch.float32 and x.is_cpu and not torch.compiler.is_compiling() \
        and not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params()))) \
        and _LIB.loaded() is not None


class NativeFloatMoE(_Packs, MoE):
    """Drop-in for a float ``MoE`` that :func:`supported` (module docstring); holds the same submodules."""

    def __init__(self, moe: MoE, stacks: tuple = (None, None)):
        """``stacks``: the routed experts' and the shared expert's packs (:func:`bits_mlps`; None: packed on
        first use)."""
        nn.Module.__init__(self)
        if not supported(moe):
            raise ValueError("NativeFloatMoE: every routed expert must be an MLP of bias-free float32 linears "
                             "holding bf16 values, all of one shape")
        self.gate, self.experts, self.shared_experts = moe.gate, moe.experts, moe.shared_experts
        self.last_load: Optional[torch.Tensor] = moe.last_load
        self.register_load_state_dict_post_hook(drop_pack)
        if any(s is not None for s in stacks):
            self.__dict__["_packed_ffn"] = self._pack(stacks)

    def _pack(self, stacks: tuple = (None, None)) -> Optional[PackedFFN]:
        sh = self.shared_experts
        H = self.experts[0].gate_proj.in_features
        sh = sh if plain_mlp(sh) and sh.gate_proj.in_features == H else None
        return PackedFFN(list(self.experts), sh, stacks=stacks) if supported(self) else None

    def packed(self) -> Optional[PackedFFN]:
        """The packed experts (the shared expert with them when it is a plain MLP of the same hidden size),
        None when the routed experts no longer fit (e.g. after ``.to(torch.bfloat16)``)."""
        d = self.__dict__
        if "_packed_ffn" not in d:
            d["_packed_ffn"] = self._pack()
        return d["_packed_ffn"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pk = self.packed() if _c_input(x, self.experts.parameters) else None
        if pk is None or x.shape[-1] != pk.H:
            return super().forward(x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx = self.gate(flat)
        out, self.last_load = _run(pk, flat, weights, idx)
        if self.shared_experts is not None and not pk.Is:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class NativeFloatMLP(_Packs, MLP):
    """Drop-in for a dense ``MLP`` that :func:`plain_mlp` (module docstring); holds the same linears."""

    def __init__(self, mlp: MLP, stack: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        """``stack``: its pack (:func:`bits_mlps`; None: packed on first use)."""
        nn.Module.__init__(self)
        if not plain_mlp(mlp):
            raise ValueError("NativeFloatMLP: an MLP of bias-free float32 linears holding bf16 values is needed")
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.register_load_state_dict_post_hook(drop_pack)
        if stack is not None:
            self.__dict__["_packed_ffn"] = PackedFFN([], self, "", (None, stack))

    def packed(self) -> Optional[PackedFFN]:
        """The packed linears, None when they no longer fit (e.g. after ``.to(torch.bfloat16)``)."""
        d = self.__dict__
        if "_packed_ffn" not in d:
            d["_packed_ffn"] = PackedFFN([], self, "") if plain_mlp(self) else None
        return d["_packed_ffn"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H = self.gate_proj.in_features
        pk = self.packed() if x.shape[-1] == H and x.numel() <= FFN_C_ROWS * H \
            and _c_input(x, self.parameters) else None
        if pk is None:
            return super().forward(x)
        return _run(pk, x.reshape(-1, H))[0].view(*x.shape[:-1], H)
