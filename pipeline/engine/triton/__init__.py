"""Triton kernels for the engine's hot paths on a GPU: int8-latent MLA decode, the int8 linears, the int8 MoE.

Modules (each imports ``triton`` when it is imported; importing this package imports nothing):

- :mod:`.mla_decode` -- ``paged_mla_decode``: one decode step of absorbed MLA for a batch of sequences of
  different lengths over the paged latent cache of ``pipeline.engine.cache.paged_cache`` (int8 latent with the
  layer's ``fa_k``, or a bf16/float latent; ND or NZ blocks read in place), split-K (flash-decoding) plus a
  reduction kernel. Same meaning as ``pipeline.engine.attention.paged.paged_decode_attention``.
- :mod:`.int8_gemm` -- the W8A8 (static) and W8A8_DYNAMIC linears of ``pipeline.engine.layers.qlinear`` with the
  activation quantization and the FAST epilogue fused around an exact int8 x int8 -> int32 GEMM; the
  linears run it on the triton backend (the EXACT epilogue on its int32 product).
- :mod:`.moe_gemm` -- ``fused_moe``: the routed experts of ``pipeline.engine.layers.moe.Int8MoE`` as two grouped
  int8 GEMMs over tokens sorted by expert (gate+up with SiLU-mul fused, then down with the per-token
  quantization fused), combined with an ``index_add``.

Which kernels run is chosen in ``pipeline.engine.config`` (``backend(device)``: ``"triton"`` on CUDA when
triton imports, ``DSQUANT_KERNELS`` overrides it), once per device, when the engine is built.

What is exact: the integer parts (the activations quantized to int8, the int32 accumulators, ``acc +
quant_bias``) equal the torch path's bit for bit; the float parts (softmax, the epilogue products, SiLU)
follow the torch path's formulas in float32 and differ from it only by rounding (each module states its
bound, the tests measure it).

CPU: with ``TRITON_INTERPRET=1`` set before a kernel module is imported, the same kernels run on CPU
tensors through Triton's interpreter (slow; it is how the tests check them on a machine without a GPU).
"""
