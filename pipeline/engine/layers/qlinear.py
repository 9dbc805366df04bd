"""Int8 linears that compute with the stored integers of a W8A8 / W8A8_DYNAMIC linear (docs/format.md).

The arithmetic, for a linear with int8 weight ``W8`` [n, k] and an input ``x`` [..., k] (any float dtype;
the output has x's dtype, as the fake-quant reference's ``QuantLinear``):

- W8A8 (static activations, per tensor, asymmetric), in float32 like the quantizer::

      x_q = clamp(round(x / input_scale + input_offset), -128, 127)            int8, round half to even
      y   = deq_scale * (x_q @ W8.T + quant_bias)                               acc exact, epilogue float64

  ``quant_bias`` already holds ``bias / deq_scale`` (msModelSlim folds the bias into it), so a stored
  ``bias`` tensor is validated but not added a second time.
- W8A8_DYNAMIC (per token, symmetric)::

      s_tok = max(max_j |x_j| / 127, eps)      x_q = clamp(round(x / s_tok), -128, 127)
      y     = (x_q @ W8.T) * s_tok * weight_scale.T  (+ bias, when the linear has one)

``deq_scale`` is float32 (bf16 models) or int64 holding the float32 bit pattern in its low 32 bits (fp16
models). The integer product is exact on every kernel (:func:`int8_matmul`). Two epilogues
(``epilogue``, per module):

- ``exact`` (the reference mode, and the default): the fake-quant reference's (exact integers to float64, multiplied in
  float64 in the same order, rounded to float32, then to x's dtype), so the output equals
  ``QuantLinear``'s bit for bit;
- ``fast``: the same products in float32, on the int32 accumulator (W8A8: ``acc +
  quant_bias`` is added in int32, exact). Each of its at most three float32 roundings (the integer to
  float32, exact while |acc| <= 2^24; then one or two multiplies) is within half an ulp, so the float32
  result is within 4 ulps of the exact one (FAST_EPILOGUE_ULPS; the tests measure it) and, cast to
  bf16, within one bf16 ulp, where a float32 result falls on the other side of a bf16 rounding boundary.

Kernels of the integer product (``int_mm``, ``fp32_chunked``, ``float64``: :mod:`pipeline.engine.int8_arith`,
which says why each is exact; a module's ``kernel`` forces one, ``last_kernel`` says which ran), and:

- ``native``: the whole forward (quantize, int32 product, epilogue) in one C call on the CPU
  (:mod:`pipeline.engine.native.cpu_linear`), bit-identical to the torch path in both epilogues. ``auto`` takes
  it where the module's ``native`` is on (chosen when it is built: the engine's kernels, or for a module
  built alone :func:`native_default`: the kernels backend ``native`` and the library built) for
  float32 / bf16 input (int8 rows for ``apply_quantized`` and ``_acc``) of any size when the C kernels'
  pool has as many threads as torch (``cpu_linear.threads``: an engine keeps them equal),
  else of at most ``cpu_linear.max_rows(k, n)`` rows (64, fewer for wide weights); larger batches keep
  ``select_kernel``'s. ``kernel="native"`` forces it (an error where it cannot run);
  ``DSQUANT_KERNELS=torch``, ``DSQUANT_NATIVE=0`` or ``DSQUANT_NATIVE_LINEAR=0`` when it is built turn it
  off. The C
  kernel keeps a packed copy of the weight, dropped on ``load_state_dict``, buffer assignment and
  ``.to()`` (cpu_linear's docstring).

- ``triton``: on the kernels backend ``triton`` (CUDA with triton installed; on a CPU
  ``DSQUANT_KERNELS=triton`` with ``TRITON_INTERPRET=1``), the Triton GEMMs of
  :mod:`pipeline.engine.triton.int8_gemm`. ``auto`` takes them where the module's ``triton`` is on (chosen
  when it is built, as ``native``: the engine's kernels, or :func:`triton_default`): with the ``fast``
  epilogue the whole forward (quantization, int32 product, epilogue fused), the torch path's ``fast``
  output bit for bit; with ``exact`` (and for ``apply_quantized``) the exact int32 product, the epilogue
  in torch as above.

Activations are not checked for NaN/Inf here (the hot path; runtimes do not either); every stored tensor
is checked once, when the module is built (:func:`build_int8_linear`).
"""

from __future__ import annotations

import os
import weakref
from typing import Mapping, Optional

import torch
from torch import Tensor, nn

from pipeline.engine import config
from pipeline.engine.native import cpu_linear
from pipeline.engine.int8_arith import (FP32_CHUNKED, INT_MM, INT_MM_MAX_K, KERNELS, QMAX, QMIN, SCALE_DTYPES, DeviceLike,
                                       Int8LinearError, _bits_to_float32, _int_mm_int32, decode_deq_scale,
                                       int8_matmul, quantize_per_token, quantize_static, select_kernel)
from pipeline.format.description import FLOAT, QUANT_KINDS, W8A8, W8A8_DYNAMIC

NATIVE = "native"                                 # the fused C forward (module docstring)
_FLOAT_DTYPES, _INT8 = (torch.float32, torch.bfloat16), (torch.int8,)   # the C kernel's inputs
AUTO = "auto"
EXACT, FAST = "exact", "fast"                     # epilogues (module docstring)
TRITON = "triton"                                 # last_kernel of a call through the Triton GEMMs
EPILOGUES = (EXACT, FAST)
FAST_EPILOGUE_ULPS = 4                            # fast vs exact, float32 output (module docstring)


# ----- the modules ---------------------------------------------------------------------------------
_defaults: dict[tuple, bool] = {}


def native_default(device) -> bool:
    """Whether the C kernel may serve a module built on ``device`` outside an engine: the kernels resolved
    from the environment now (pipeline.engine.config; once per device and switch values)."""
    dev = torch.device(device)
    key = (dev.type,) + tuple(os.environ.get(v) for v in (config.ENV, "DSQUANT_NATIVE", "DSQUANT_NATIVE_LINEAR"))
    hit = _defaults.get(key)
    if hit is None:
        hit = _defaults[key] = dev.type == "cpu" and config.backend(dev) == config.NATIVE \
            and cpu_linear.library() is not None
    return hit


def triton_default(device) -> bool:
    """Whether a module built alone on ``device`` runs the Triton GEMMs: the kernels backend ``triton``
    there, read from the environment now (once per device and switch values; False where the environment
    names a backend that cannot run there: the engine's :func:`config.resolve` reports that)."""
    dev = torch.device(device)
    key = ("triton", dev.type) + tuple(os.environ.get(v) for v in (config.ENV, "TRITON_INTERPRET"))
    hit = _defaults.get(key)
    if hit is None:
        try:
            hit = config.backend(dev) == config.TRITON
        except (RuntimeError, ValueError):
            hit = False
        _defaults[key] = hit
    return hit


class Int8Linear(nn.Module):
    """Common part: the int8 weight, the kernel choice and the exact product. ``kernel``: "auto" (see
    :func:`select_kernel`) or one of KERNELS; ``last_kernel``: the kernel of the last forward;
    ``epilogue``: EXACT (the reference) or FAST (see the module docstring)."""

    kind = ""

    def __init__(self, name: str, weight: Tensor, bias: Optional[Tensor] = None, kernel: str = AUTO,
                 epilogue: str = EXACT, native: Optional[bool] = None):
        super().__init__()
        if epilogue not in EPILOGUES:
            raise Int8LinearError(f"{name}: unknown epilogue {epilogue!r} (known: {', '.join(EPILOGUES)})")
        self.epilogue = epilogue
        self.name = name
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        if kernel not in (AUTO, NATIVE) + KERNELS:
            raise Int8LinearError(f"{name}: unknown kernel {kernel!r} (known: auto, {', '.join(KERNELS)}, native)")
        self.kernel = kernel
        self.native = native_default(weight.device) if native is None else bool(native)  # may C serve it
        self.triton = triton_default(weight.device)                  # may the Triton GEMMs serve it
        self.last_kernel: Optional[str] = None
        self._native_rows = cpu_linear.max_rows(self.in_features, self.out_features)   # auto, several threads
        self.register_load_state_dict_post_hook(cpu_linear.drop)     # the C kernel's packed copy is stale
        self.register_load_state_dict_pre_hook(_loading)             # a compact module takes its weight back
        self.register_state_dict_post_hook(_with_weight)             # ... and gives it in state_dict()
        self._w_f32: Optional[Tensor] = None  # float32 copy of weight for fp32_chunked, made on first use
        self._w_f32_key: Optional[tuple] = None  # (weakref to the weight it was made from, its version)

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__.get("_buffers", ()):     # a buffer replaced: the packed copy is stale
            cpu_linear.drop(self)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        cpu_linear.drop(self)                             # .to(), .float(), ...: new tensors
        return super()._apply(fn, recurse)

    def int8_weight(self) -> Tensor:
        """The int8 weight [n, k]: the ``weight`` buffer, or a compact module's read back from its packed
        copy (cpu_linear.compact: the engine's loader keeps only the C kernels' layout)."""
        return cpu_linear.weight_of(self)

    def kernel_for(self, device: DeviceLike) -> str:
        """The integer-product kernel of the torch path on ``device`` (``native`` is chosen per call:
        :meth:`_native`)."""
        if self.kernel in (AUTO, NATIVE):
            return select_kernel(device, self.out_features, self.in_features)
        if self.kernel not in KERNELS:
            raise Int8LinearError(f"{self.name}: unknown kernel {self.kernel!r} (known: auto, {', '.join(KERNELS)}, "
                                  f"native)")
        return self.kernel

    def _native(self, x, dtypes: tuple = _FLOAT_DTYPES) -> bool:
        """Whether this call runs the C kernel (module docstring): ``x`` a CPU tensor [..., in_features] of
        one of ``dtypes``; for ``auto``, at most ``cpu_linear.max_rows`` rows unless torch runs one thread.
        Records it in ``last_kernel``.
        Anything else is left to the torch path (which names what is wrong with the input)."""
        kernel = self.kernel
        if kernel != AUTO and kernel != NATIVE:
            return False
        ok = isinstance(x, Tensor) and x.dim() > 0 and x.shape[-1] == self.in_features <= cpu_linear.MAX_K
        if not (ok and x.dtype in dtypes and self.native and x.device.type == "cpu"):
            if kernel == NATIVE and ok:
                why = cpu_linear.status() if self.native else "the C kernels were off when it was built"
                raise Int8LinearError(f"{self.name}: kernel 'native' cannot run on {x.device} for {x.dtype} "
                                      f"input ({why}; it takes {', '.join(map(str, dtypes))})")
            return False
        if kernel == AUTO and x.numel() > self._native_rows * self.in_features \
                and torch.get_num_threads() > cpu_linear.threads():
            return False
        self.__dict__["last_kernel"] = NATIVE       # (nn.Module.__setattr__ costs a microsecond)
        return True

    def _triton(self, x) -> bool:
        """Whether this call runs the Triton GEMMs (module docstring): ``auto``, the module's ``triton`` on,
        ``x`` a tensor [..., in_features] off the CPU, or on it through the interpreter (the backend said
        which when the module was built)."""
        return (self.triton and self.kernel == AUTO and isinstance(x, Tensor) and x.dim() > 0
                and x.shape[-1] == self.in_features <= INT_MM_MAX_K)

    def _fused(self, x: Tensor) -> Optional[Tensor]:
        """The ``fast`` forward through the fused Triton GEMM (float32 [..., out_features]), or None where it
        does not run (another epilogue or kernel, a non-float input)."""
        if self.epilogue != FAST or not self._triton(x) or not x.is_floating_point():
            return None
        from pipeline.engine.triton.int8_gemm import int8_linear

        self.last_kernel = TRITON
        return int8_linear(self, x)

    def _flat(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0 or x.shape[-1] != self.in_features:
            what = f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise Int8LinearError(f"{self.name}: input must be a float tensor [..., {self.in_features}], got {what}")
        return x.reshape(-1, self.in_features)

    def _acc(self, x_q: Tensor) -> Tensor:
        """Exact x_q @ weight.T [m, n]: int32 from ``int_mm``, float64 from the other kernels; records the
        kernel in ``last_kernel``."""
        if x_q.dim() == 2 and self._native(x_q, _INT8):
            return cpu_linear.apply_quantized(self, x_q, None)
        weight = self.int8_weight()
        if self._triton(x_q):
            from pipeline.engine.triton.int8_gemm import int8_matmul_acc

            self.last_kernel = TRITON
            return int8_matmul_acc(x_q, weight)
        kernel = self.kernel_for(x_q.device)
        if kernel == INT_MM:
            self.last_kernel = kernel
            return _int_mm_int32(x_q, weight)
        w_f32 = None
        if kernel == FP32_CHUNKED:
            # first use, moved, replaced or changed in place (load_state_dict); by the tensor itself, not its
            # address, which a new tensor (a compact module's weight read back) may reuse
            key = self._w_f32_key
            if key is None or key[0]() is not weight or key[1] != weight._version:
                self._w_f32, self._w_f32_key = weight.float(), (weakref.ref(weight), weight._version)
            w_f32 = self._w_f32
        self.last_kernel = kernel
        return int8_matmul(x_q, weight, kernel, w_f32)

    def extra_repr(self) -> str:
        return (f"{self.name}: {self.kind}, in={self.in_features}, out={self.out_features}, kernel={self.kernel}, "
                f"epilogue={self.epilogue}")


class W8A8StaticLinear(Int8Linear):
    """W8A8: y = deq_scale * (x_q @ W8.T + quant_bias), x_q = clamp(round(x / s + o), -128, 127).
    The epilogue: (acc + quant_bias) in float64 (exact), times float64(deq_scale), to float32, to x.dtype.
    A stored ``bias`` is already inside quant_bias and is not added again."""

    kind = W8A8

    def __init__(self, name: str, weight: Tensor, input_scale: Tensor, input_offset: Tensor,
                 quant_bias: Tensor, deq_scale: Tensor, bias: Optional[Tensor] = None, kernel: str = AUTO,
                 epilogue: str = EXACT):
        super().__init__(name, weight, bias, kernel, epilogue)
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("input_offset", input_offset)
        self.register_buffer("quant_bias", quant_bias)
        self.register_buffer("deq_scale", deq_scale)
        decode_deq_scale(deq_scale, f"{name}.deq_scale")

    def forward(self, x: Tensor) -> Tensor:
        # the small tensors are converted on every call (n values), so load_state_dict is always honoured
        if self._native(x):
            return cpu_linear.forward(self, x)
        y = self._fused(x)
        if y is not None:
            return y.to(x.dtype)
        x2 = self._flat(x)
        y = self.finish(self._acc(self.quantize_input(x2)))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def deq_float32(self) -> Tensor:
        """deq_scale as float32 values (either stored form: :func:`decode_deq_scale`'s reading)."""
        return _bits_to_float32(self.deq_scale)

    def quantize_input(self, x2: Tensor) -> Tensor:
        """The int8 activations [m, k] of float rows ``x2`` (elementwise: a slice of the columns quantizes
        to the same slice of the int8 row)."""
        return quantize_static(x2, self.input_scale.reshape(()), self.input_offset.reshape(()))

    def finish(self, acc: Tensor) -> Tensor:
        """The epilogue on the exact accumulator [m, n] (int32 or float64 integers): float32 [m, n]."""
        deq = _bits_to_float32(self.deq_scale)
        if self.epilogue == EXACT:
            y = acc.double().add_(self.quant_bias).mul_(deq.double()).float()
        else:  # int32 (or float64) + int32: exact (|sum| < 2^31); then one conversion, one multiply
            y = acc.add_(self.quant_bias).float().mul_(deq)
        return y


class W8A8DynamicLinear(Int8Linear):
    """W8A8_DYNAMIC: y = (x_q @ W8.T) * s_tok * weight_scale.T (+ bias), x_q, s_tok per token.
    The epilogue: acc (float64, exact) times float64(s_tok), times float64(weight_scale), to float32;
    the bias (if any) added in float32; then x.dtype."""

    kind = W8A8_DYNAMIC

    def __init__(self, name: str, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor] = None,
                 kernel: str = AUTO, epilogue: str = EXACT):
        super().__init__(name, weight, bias, kernel, epilogue)
        self.register_buffer("weight_scale", weight_scale)

    def forward(self, x: Tensor) -> Tensor:
        if self._native(x):
            return cpu_linear.forward(self, x)
        y = self._fused(x)
        if y is not None:
            return y.to(x.dtype)
        x2 = self._flat(x)
        y = self.apply_quantized(*quantize_per_token(x2))
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def apply_quantized(self, x_q: Tensor, s_tok: Tensor) -> Tensor:
        """The float32 output [m, n] (no bias, not cast) for activations already quantized per token
        (``quantize_per_token``: several linears reading the same input quantize it once)."""
        if x_q.dim() == 2 and self._native(x_q, _INT8):
            return cpu_linear.apply_quantized(self, x_q, s_tok)
        return self.finish(self._acc(x_q), s_tok)

    def finish(self, acc: Tensor, s_tok: Tensor) -> Tensor:
        """The epilogue on the exact accumulator [m, n] and the per-token scales [m, 1]: float32 [m, n]."""
        if self.epilogue == EXACT:
            return acc.double().mul_(s_tok.double()).mul_(self.weight_scale.double().reshape(1, -1)).float()
        return acc.float().mul_(s_tok).mul_(self.weight_scale.float().reshape(1, -1))


def _loading(module: Int8Linear, state_dict, prefix: str, *args) -> None:
    """load_state_dict pre hook: a compact module loads into its weight buffer like any other."""
    if cpu_linear.is_compact(module):
        cpu_linear.drop(module)


def _with_weight(module: Int8Linear, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post hook: a compact module's weight, read back from its packed copy."""
    if cpu_linear.is_compact(module):
        state_dict[prefix + "weight"] = module.int8_weight()


# ----- building from a quantized directory ----------------------------------------------------------
def by_linear(tensors: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """Every tensor filed under its linear: ``{prefix: {leaf: tensor}}`` in one pass (a name index, so
    building each of a model's linears does not scan every tensor)."""
    out: dict[str, dict[str, Tensor]] = {}
    for k, v in tensors.items():
        prefix, _, leaf = k.rpartition(".")
        out.setdefault(prefix, {})[leaf] = v
    return out


def linear_tensors(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The tensors of linear ``prefix`` keyed by leaf: ``{prefix}.input_scale`` -> ``input_scale``."""
    p = prefix + "."
    return {k[len(p):]: v for k, v in tensors.items() if k.startswith(p) and "." not in k[len(p):]}


def build_int8_linear(name: str, kind: str, params: Mapping[str, Tensor], kernel: str = AUTO,
                      epilogue: str = EXACT) -> Int8Linear:
    """The module of linear ``name`` of type ``kind`` (W8A8 or W8A8_DYNAMIC) from its tensors keyed by
    leaf name as in docs/format.md (both dialects: seed, and ascendV1 with float32 scales and no
    weight_scale on static layers). The module holds the given tensors as its buffers (no copy). Raises
    Int8LinearError (a ValueError) naming the linear and the tensor
    that is missing or bad."""
    if kind not in QUANT_KINDS:
        why = "is not quantized" if kind == FLOAT else "is not a quantized linear type"
        raise Int8LinearError(f"{name}: type {kind!r} {why} (expected {' or '.join(QUANT_KINDS)})")
    weight = _get(params, name, "weight")
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.numel() == 0:
        raise Int8LinearError(f"{name}.weight: expected a non-empty int8 [n, k], got {weight.dtype} "
                              f"{list(weight.shape)}")
    n = weight.shape[0]
    bias = params.get("bias")
    if bias is not None:
        _check_float(bias, f"{name}.bias", (n,))
    if "weight_offset" in params:
        wo = params["weight_offset"]
        _check_float(wo, f"{name}.weight_offset", (n, 1), allow_flat=True)
        if bool((wo != 0).any()):
            raise Int8LinearError(f"{name}.weight_offset: must be all zeros (symmetric weights), "
                                  f"{int((wo != 0).sum())} are not")
    if kind == W8A8_DYNAMIC:
        ws = _get(params, name, "weight_scale")
        _check_float(ws, f"{name}.weight_scale", (n, 1), allow_flat=True)
        _check_nonnegative(ws, f"{name}.weight_scale")
        return W8A8DynamicLinear(name, weight, ws.reshape(n, 1), bias, kernel, epilogue)

    s = _get(params, name, "input_scale")
    _check_float(s, f"{name}.input_scale", (1,), allow_flat=True)
    if not float(s.reshape(-1)[0]) > 0:
        raise Int8LinearError(f"{name}.input_scale: must be > 0, got {float(s.reshape(-1)[0])}")
    o = _get(params, name, "input_offset")
    if o.numel() != 1 or not (o.is_floating_point() or o.dtype in (torch.int8, torch.int32, torch.int64)):
        raise Int8LinearError(f"{name}.input_offset: expected one float or integer value, got {o.dtype} "
                              f"{list(o.shape)}")
    off = float(o.reshape(-1)[0])
    if off != off or off != round(off) or not QMIN <= off <= QMAX:
        raise Int8LinearError(f"{name}.input_offset: must be an integer in [{QMIN}, {QMAX}], got {off}")
    qb = _get(params, name, "quant_bias")
    if qb.dtype != torch.int32 or tuple(qb.shape) != (n,):
        raise Int8LinearError(f"{name}.quant_bias: expected int32 [{n}], got {qb.dtype} {list(qb.shape)}")
    deq = _get(params, name, "deq_scale")
    if tuple(deq.shape) != (n,):
        raise Int8LinearError(f"{name}.deq_scale: expected shape [{n}], got {list(deq.shape)}")
    decode_deq_scale(deq, f"{name}.deq_scale")
    return W8A8StaticLinear(name, weight, s.reshape(1), o.reshape(1), qb, deq, bias, kernel, epilogue)


def build_from_checkpoint(prefix: str, tensors: Mapping[str, Tensor], types: Mapping[str, str],
                          kernel: str = AUTO, epilogue: str = EXACT) -> Int8Linear:
    """The module of linear ``prefix`` from a whole directory's tensors and description types (the type
    is that of ``{prefix}.weight``, as readers decide it)."""
    key = prefix + ".weight"
    if key not in types:
        raise Int8LinearError(f"{prefix}: no '{key}' entry in the description")
    return build_int8_linear(prefix, types[key], linear_tensors(tensors, prefix), kernel, epilogue)


def _get(params: Mapping[str, Tensor], name: str, leaf: str) -> Tensor:
    t = params.get(leaf)
    if t is None:
        raise Int8LinearError(f"{name}.{leaf}: missing (have: {', '.join(sorted(params)) or 'nothing'})")
    if not isinstance(t, Tensor):
        raise Int8LinearError(f"{name}.{leaf}: expected a tensor, got {type(t).__name__}")
    return t


def _check_float(t: Tensor, name: str, shape: tuple, allow_flat: bool = False) -> None:
    """A finite float tensor (bf16, fp16 or float32) of ``shape`` (or, with allow_flat, ``[prod(shape)]``)."""
    shapes = {tuple(shape)} | ({(int(torch.tensor(shape).prod()),)} if allow_flat else set())
    if t.dtype not in SCALE_DTYPES or tuple(t.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in sorted(shapes, key=len, reverse=True))
        raise Int8LinearError(f"{name}: expected a float tensor {want}, got {t.dtype} {list(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise Int8LinearError(f"{name}: {int((~torch.isfinite(t)).sum())} non-finite values")


def _check_nonnegative(t: Tensor, name: str) -> None:
    if bool((t < 0).any()):
        raise Int8LinearError(f"{name}: negative values (min {float(t.min())})")
