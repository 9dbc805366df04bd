"""Checkpoints written in the DeepSeek-V3 release's layout: a checkpoint's FP8 block-quantized copy
(``fp8_copy``) and random-weight checkpoints at the real width (``synthetic``)."""
