"""The serving protocol, without Ray: the OpenAI-compatible endpoints (``endpoints``: request validation,
responses, SSE chunks, incremental detokenization) on the parts beside them (errors, output options,
logprobs, structured outputs, tool calls, R1's reasoning split), and MindIE's ModelConfig block. The Serve
deployments in ``actors/`` use it. Beside it, ``sharding``: one replica sharded over ranks on paper
(capacity and communication, for planning a deployment)."""
