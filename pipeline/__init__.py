"""The pure library (no Ray). One folder per part:

- ``config``, ``layout``: the model's config and its checkpoint's tensor names, which every part shares;
  ``strict``: building dataclasses from plain data;
- ``io``: storage, safetensors, the checkpoint reader (FP8 on the fly);
- ``model``: the float model, loading it, perplexity;
- ``format``: the quantized directory (description, dialects, checker, reader);
- ``quant``: the quantizer that writes it;
- ``plan``: planning a distributed quantization job;
- ``engine``: the inference engine that runs it;
- ``serving``: the OpenAI protocol and MindIE's config, for the Serve deployments in ``actors/``;
- ``text``: tokenizer and corpus; ``assets``: the embedded model.
"""
