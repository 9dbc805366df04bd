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

Kernels (:func:`select_kernel`; a module's ``kernel`` forces one, ``last_kernel`` says which ran):

- ``int_mm``: ``torch._int_mm`` (int8 x int8 -> int32), the default on every device when k and n are multiples of 8 and
  k <= 131071 (|acc| <= 128 * 128 * k stays inside int32); on CUDA, fewer than 17 rows are zero-padded to
  32 (its kernel refuses them; the CPU's takes any number of rows). The shape rule holds on every device
  (on the CPU, torch 2.13's ``_int_mm`` returns garbage for k = 1).
- ``fp32_chunked``: the CPU fallback for shapes ``_int_mm`` refuses. fp32 GEMMs over K-chunks of 1024 columns: every partial sum of a
  chunk is an integer of magnitude <= 128 * 128 * 1024 = 2^24, all of which float32 holds exactly, so each
  chunk's product is exact whatever order the GEMM sums in; chunks are summed in float64 (exact below 2^53).
- ``float64``: one float64 GEMM, exact for k < 2^39; CUDA's fallback for shapes ``_int_mm`` refuses.
- ``native``: the whole forward (quantize, int32 product, epilogue) in one C call on the CPU
  (:mod:`pipeline.engine.cpu_linear`), bit-identical to the torch path in both epilogues. ``auto`` takes
  it where :func:`cpu_linear.enabled` (the kernels backend is ``native`` and the library built) for
  float32 / bf16 input (int8 rows for ``apply_quantized`` and ``_acc``) of any size when torch runs one
  intra-op thread (``_int_mm`` then has no second core: the C kernel measured faster up to 2048 rows),
  else of at most ``cpu_linear.max_rows(k, n)`` rows (64, fewer for wide weights); larger batches keep
  ``select_kernel``'s. ``kernel="native"`` forces it (an error where it cannot run);
  ``DSQUANT_KERNELS=torch``, ``DSQUANT_NATIVE=0`` or ``DSQUANT_NATIVE_LINEAR=0`` turn it off. The C
  kernel keeps a packed copy of the weight, dropped on ``load_state_dict``, buffer assignment and
  ``.to()`` (cpu_linear's docstring).

Activations are not checked for NaN/Inf here (the hot path; runtimes do not either); every stored tensor
is checked once, when the module is built (:func:`build_int8_linear`).
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

import torch
from torch import Tensor, nn

from pipeline.engine import cpu_linear
from pipeline.format.description import FLOAT, QUANT_KINDS, W8A8, W8A8_DYNAMIC

QMIN, QMAX = -128, 127
F32_EPS = torch.finfo(torch.float32).eps
INT_MM, FP32_CHUNKED, FLOAT64 = "int_mm", "fp32_chunked", "float64"
KERNELS = (INT_MM, FP32_CHUNKED, FLOAT64)         # int8_matmul's
NATIVE = "native"                                 # the fused C forward (module docstring)
_FLOAT_DTYPES, _INT8 = (torch.float32, torch.bfloat16), (torch.int8,)   # the C kernel's inputs
AUTO = "auto"
EXACT, FAST = "exact", "fast"                     # epilogues (module docstring)
EPILOGUES = (EXACT, FAST)
FAST_EPILOGUE_ULPS = 4                            # fast vs exact, float32 output (module docstring)
MAX_ABS_PRODUCT = 128 * 128                       # |x_q * w| <= 2^14
FP32_EXACT_CHUNK = 2 ** 24 // MAX_ABS_PRODUCT     # 1024: every partial sum of a chunk is an exact float32
INT_MM_MAX_K = (2 ** 31 - 1) // MAX_ABS_PRODUCT   # 131071: the int32 accumulator cannot overflow
INT_MM_MIN_ROWS = 17                              # torch._int_mm on CUDA needs more than 16 rows
INT_MM_PAD_ROWS = 32
FLOAT64_MAX_K = 2 ** 53 // MAX_ABS_PRODUCT
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DeviceLike = Union[str, torch.device]


class Int8LinearError(ValueError):
    """A bad stored tensor, type or input of an int8 linear; the message names the linear and the tensor."""


# ----- activation quantization ---------------------------------------------------------------------
def quantize_static(x: Tensor, input_scale: Tensor, input_offset: Tensor) -> Tensor:
    """x [..., k] -> int8 clamp(round(x / s + o), -128, 127), computed in float32 (round half to even):
    the quantizer's (qparams.quantize_static) formula, op for op."""
    q = torch.round(x.float() / input_scale.float() + input_offset.float())
    return torch.clamp(q, QMIN, QMAX).to(torch.int8)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., k] -> (x_q int8 [..., k], s_tok float32 [..., 1]): s_tok = max(max_j |x_j| / 127, eps),
    x_q = clamp(round(x / s_tok), -128, 127), in float32 (qparams.dynamic_quant_per_token's formula)."""
    xf = x.float()
    return quantize_with_absmax(xf, xf.abs().amax(dim=-1, keepdim=True))


def quantize_with_absmax(xf: Tensor, absmax: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`quantize_per_token` of float32 ``xf`` given its rows' absmax [..., 1] (a row-parallel linear
    holds a slice of each row and all-reduces the slices' maxima first: the same scale, the same int8)."""
    s = torch.clamp(absmax / 127, min=F32_EPS)
    return torch.clamp(torch.round(xf / s), QMIN, QMAX).to(torch.int8), s


# ----- deq_scale -----------------------------------------------------------------------------------
def decode_deq_scale(deq: Tensor, name: str = "deq_scale") -> Tensor:
    """The float32 deq_scale of either stored form: float32 as is; int64 -> its low 32 bits read as a
    float32 bit pattern. The high 32 bits must be zero or the sign extension of bit 31 (how
    ``view(int32).to(int64)`` writes it); anything else is not a bit pattern. The values must be finite
    and >= 0 (deq_scale = input_scale * weight_scale)."""
    if not isinstance(deq, Tensor):
        raise Int8LinearError(f"{name}: expected a tensor, got {type(deq).__name__}")
    if deq.dtype == torch.float32:
        out = deq
    elif deq.dtype == torch.int64:
        if deq.numel() and (int(deq.min()) < -2 ** 31 or int(deq.max()) >= 2 ** 32):
            raise Int8LinearError(f"{name}: int64 values outside [-2^31, 2^32) are not float32 bit patterns "
                                  f"(min {int(deq.min())}, max {int(deq.max())})")
        out = _bits_to_float32(deq)
    else:
        raise Int8LinearError(f"{name}: dtype {deq.dtype}; expected float32, or int64 holding float32 bit "
                              f"patterns (fp16 models)")
    if out.numel() and not bool(torch.isfinite(out).all()):
        raise Int8LinearError(f"{name}: {int((~torch.isfinite(out)).sum())} non-finite values")
    if out.numel() and bool((out < 0).any()):
        raise Int8LinearError(f"{name}: negative values (min {float(out.min())})")
    return out


def _bits_to_float32(deq: Tensor) -> Tensor:
    """int64 -> float32 read from the low 32 bits (no checks; float32 passes through)."""
    if deq.dtype == torch.float32:
        return deq
    low = deq & 0xFFFFFFFF                                            # [0, 2^32)
    return torch.where(low >= 2 ** 31, low - 2 ** 32, low).to(torch.int32).view(torch.float32)


# ----- the exact integer product -------------------------------------------------------------------
def select_kernel(device: DeviceLike, n: int, k: int) -> str:
    """The kernel a linear with weight [n, k] uses on ``device``: ``int_mm`` when k % 8 == 0, n % 8 == 0
    and k <= INT_MM_MAX_K (on CUDA and on the CPU: torch 2.13's CPU ``_int_mm`` measured 1.5-9x faster
    than ``fp32_chunked`` here, from 1 to 256 rows); otherwise ``float64`` on CUDA and ``fp32_chunked``
    elsewhere."""
    if k % 8 == 0 and n % 8 == 0 and 0 < k <= INT_MM_MAX_K:
        return INT_MM
    return FLOAT64 if torch.device(device).type == "cuda" else FP32_CHUNKED


def int8_matmul(x_q: Tensor, w: Tensor, kernel: str, w_f32: Optional[Tensor] = None,
                chunk: int = FP32_EXACT_CHUNK) -> Tensor:
    """x_q int8 [m, k] @ w int8 [n, k].T, exactly: float64 [m, n] holding the true integers.

    ``kernel`` is one of KERNELS (see the module docstring for why each is exact). ``w_f32``: w as float32
    (a cache, for ``fp32_chunked``). ``chunk`` (<= FP32_EXACT_CHUNK) is the K-chunk of ``fp32_chunked``."""
    if x_q.dtype != torch.int8 or w.dtype != torch.int8 or x_q.dim() != 2 or w.dim() != 2:
        raise Int8LinearError(f"int8_matmul: expected int8 [m, k] and [n, k], got {x_q.dtype} "
                              f"{list(x_q.shape)} and {w.dtype} {list(w.shape)}")
    m, k = x_q.shape
    if w.shape[1] != k:
        raise Int8LinearError(f"int8_matmul: inner dims differ: x_q {list(x_q.shape)}, w {list(w.shape)}")
    if kernel == INT_MM:
        return _int_mm(x_q, w)
    if kernel == FP32_CHUNKED:
        if not 0 < chunk <= FP32_EXACT_CHUNK:
            raise Int8LinearError(f"int8_matmul: chunk {chunk} not in [1, {FP32_EXACT_CHUNK}]: inexact")
        if w_f32 is None:
            w_f32 = w.float()
        elif w_f32.dtype != torch.float32 or w_f32.shape != w.shape:
            raise Int8LinearError(f"int8_matmul: w_f32 must be float32 {list(w.shape)}, got {w_f32.dtype} "
                                  f"{list(w_f32.shape)}")
        return _fp32_chunked(x_q, w_f32, chunk)
    if kernel == FLOAT64:
        if k >= FLOAT64_MAX_K:
            raise Int8LinearError(f"int8_matmul: k = {k} too large for an exact float64 GEMM")
        return x_q.double() @ w.double().T
    raise Int8LinearError(f"int8_matmul: unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")


def _int_mm(x_q: Tensor, w: Tensor) -> Tensor:
    return _int_mm_int32(x_q, w).double()


def _int_mm_int32(x_q: Tensor, w: Tensor) -> Tensor:
    """The int32 accumulator of ``torch._int_mm`` (shape rules checked; CUDA's small row counts padded)."""
    m, k = x_q.shape
    n = w.shape[0]
    if k > INT_MM_MAX_K:
        raise Int8LinearError(f"int8_matmul: k = {k} could overflow int_mm's int32 accumulator")
    if k % 8 or n % 8 or k == 0:  # CUDA's rule, kept on every device: torch 2.13's CPU _int_mm is wrong for k = 1
        raise Int8LinearError(f"int8_matmul: int_mm needs k and n multiples of 8, got k={k}, n={n}")
    a = x_q.contiguous()
    if m < INT_MM_MIN_ROWS and a.is_cuda:  # CUDA refuses <= 16 rows; zero rows add nothing to the rows kept
        a = torch.cat([a, a.new_zeros(INT_MM_PAD_ROWS - m, k)])
        return torch._int_mm(a, w.t())[:m]
    return torch._int_mm(a, w.t())


def _fp32_chunked(x_q: Tensor, w_f32: Tensor, chunk: int) -> Tensor:
    xf = x_q.float()
    k = xf.shape[1]
    acc: Optional[Tensor] = None
    for c0 in range(0, k, chunk):
        part = torch.mm(xf[:, c0:c0 + chunk], w_f32[:, c0:c0 + chunk].T)  # exact integers |.| <= 2^24
        acc = part.double() if acc is None else acc.add_(part)
    if acc is None:  # k == 0
        acc = xf.new_zeros(xf.shape[0], w_f32.shape[0], dtype=torch.float64)
    return acc


# ----- the modules ---------------------------------------------------------------------------------
class Int8Linear(nn.Module):
    """Common part: the int8 weight, the kernel choice and the exact product. ``kernel``: "auto" (see
    :func:`select_kernel`) or one of KERNELS; ``last_kernel``: the kernel of the last forward;
    ``epilogue``: EXACT (the reference) or FAST (see the module docstring)."""

    kind = ""

    def __init__(self, name: str, weight: Tensor, bias: Optional[Tensor] = None, kernel: str = AUTO,
                 epilogue: str = EXACT):
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
        self.last_kernel: Optional[str] = None
        self._native_rows = cpu_linear.max_rows(self.in_features, self.out_features)   # auto, several threads
        self.register_load_state_dict_post_hook(cpu_linear.drop)     # the C kernel's packed copy is stale
        self._w_f32: Optional[Tensor] = None  # float32 copy of weight for fp32_chunked, made on first use
        self._w_f32_key: Optional[tuple] = None  # (device, storage, version) of the weight it was made from

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__.get("_buffers", ()):     # a buffer replaced: the packed copy is stale
            cpu_linear.drop(self)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        cpu_linear.drop(self)                             # .to(), .float(), ...: new tensors
        return super()._apply(fn, recurse)

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
        if not (ok and x.dtype in dtypes and cpu_linear.enabled(x.device)):
            if kernel == NATIVE and ok:
                raise Int8LinearError(f"{self.name}: kernel 'native' cannot run on {x.device} for {x.dtype} "
                                      f"input ({cpu_linear.status()}; it takes {', '.join(map(str, dtypes))})")
            return False
        if kernel == AUTO and x.numel() > self._native_rows * self.in_features and torch.get_num_threads() > 1:
            return False
        self.__dict__["last_kernel"] = NATIVE       # (nn.Module.__setattr__ costs a microsecond)
        return True

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
        kernel = self.kernel_for(x_q.device)
        if kernel == INT_MM:
            self.last_kernel = kernel
            return _int_mm_int32(x_q, self.weight)
        w_f32 = None
        if kernel == FP32_CHUNKED:
            key = (self.weight.device, self.weight.data_ptr(), self.weight._version)
            if self._w_f32_key != key:  # first use, moved, replaced or changed in place (load_state_dict)
                self._w_f32, self._w_f32_key = self.weight.float(), key
            w_f32 = self._w_f32
        self.last_kernel = kernel
        return int8_matmul(x_q, self.weight, kernel, w_f32)

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
