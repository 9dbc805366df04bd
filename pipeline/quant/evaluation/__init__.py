"""Judging a quantized output: the fake-quant model and its evaluation against float, per-linear
references, the per-layer sensitivity, the measured fallback that keeps the costliest layers float, and
outlier variants of a checkpoint for tests."""
