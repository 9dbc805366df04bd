"""W8A8 + FA3 quantization into the msModelSlim format (``pipeline.format``), one concern per package, each
depending only on those listed before it:

    numerics      the quantization arithmetic (``qparams``, its C kernel in ``native``), observers, and how
                  the calibration forward multiplies (``products``)
    recipe        what a job computes: the Recipe, its YAML forms and presets, linear rules, patterns, steps
    transforms    the anti-outlier steps and rotations: smoothing, iterative and flex smoothing, QuaRot; the
                  recipe resolved once into the plan the job follows (``recipe_plan``)
    writing       a layer quantized into its output tensors, the shard layout and the writer
    calibration   the calibration forwards and their statistics, msModelSlim's layer-by-layer passes
    job           a quantize job end to end: options, preflight, estimate, stages, resumable state, ``run``
    plan          the distributed job's plan from the source's headers alone
    evaluation    fake-quant evaluation, sensitivity, measured fallback, outlier variants

No Ray."""
