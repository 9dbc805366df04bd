"""The quantization arithmetic: int8 scales and offsets of weights, activations and the FA3 cache
(``qparams``, its C kernel in ``native``), the observers that feed them, and how the calibration forward
multiplies in a reduced dtype (``products``)."""
