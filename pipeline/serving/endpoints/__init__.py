"""The OpenAI-compatible endpoints, pure: requests validated into the engine's (``openai_api``), responses
and SSE chunks (``openai_responses``), a choice's text through its parsers (``choices``) and the
tokenize / detokenize endpoints (``tokenize_api``). Built on the parts beside this package: errors,
output options, logprobs, structured outputs, tool calls, R1's reasoning split."""
