"""Reading and writing bytes: storage (local, NFS, any fsspec URL such as s3://), safetensors headers and
ranged tensor reads, the HF checkpoint reader (FP8 block-quantized weights dequantized on the fly), FP8
copies of a checkpoint, and random-weight checkpoints at the real width (``synthetic``)."""
