"""Text: the tokenizer (byte-level BPE with the DeepSeek-V3 chat template) and the corpus the embedded
model was trained on (CPython's own documentation)."""
