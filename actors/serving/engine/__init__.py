"""The engine deployments of the serving application: an engine replica (one process or sharded over
Ray actor ranks), the LLM server that streams from it, and the prefill server of the disaggregated mode."""
