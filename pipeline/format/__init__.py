"""The quantized directory msModelSlim writes for MindIE and vllm-ascend (docs/format.md): its description
file, tensor names and types, the two dialects, the checker's rules, and the reader. The quantizer writes
it, the engine and the checker read it; this package depends on neither."""
