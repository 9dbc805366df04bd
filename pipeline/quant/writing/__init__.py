"""Writing the quantized checkpoint: one layer quantized into its output tensors, the shard layout, one
unit written, the streaming writer, and the files of a finished output."""
