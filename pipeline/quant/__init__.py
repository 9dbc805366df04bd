"""W8A8 + FA3 quantization into the msModelSlim format (``pipeline.format``): the recipe, observers and
calibration, smoothing, the quantization arithmetic (``qparams``, with its C kernel in ``native``), the
shard layout and writer, job state for resumable runs, and the fake-quant evaluation. No Ray."""
