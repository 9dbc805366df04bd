"""The serving protocol, without Ray: OpenAI request validation and responses (SSE chunks, incremental
detokenization), and MindIE's ModelConfig block. The Serve deployments in ``actors/`` use it."""
