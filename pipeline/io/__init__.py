"""Reading and writing bytes: storage (local, NFS, any fsspec URL such as s3://), safetensors headers and
ranged tensor reads, the HF checkpoint reader (FP8 block-quantized weights dequantized on the fly). Above
them: where a job may write and its one-writer lock (``destination``), and checkpoints written in the
release's layout (``release_layout``: FP8 copies, random-weight checkpoints at the real width)."""
