"""W8A8 + FA3 (FAKQuant) quantization in the msModelSlim format (spec/format.md): arithmetic, observers,
calibration, the writer and the checker. Pure library code: no Ray."""
