"""The pure library: model, checkpoint I/O, quantization math, KV cache, engine. Imports no Ray."""
