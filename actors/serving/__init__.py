"""The serving application on Ray Serve: its configuration (``serve_config``), the engine deployments
(``engine``: the LLM server, the prefill server, a sharded replica's ranks) and the HTTP side (``app``: the
OpenAI ingress, its engine client, streams, limits and metrics, the proxy guards, the application builder)."""
