"""The inference engine: int8 linears, the paged (int8, ND or NZ) latent cache and its attention, the
continuous-batching scheduler, MTP drafting, sampling, the step loop on its own thread (``engine_loop``),
and the float model's plain generation loop (``reference``) it is compared against."""
