"""The HTTP side of the serving application and the application itself: the OpenAI ingress, its view of
the engine, the event streams of a request, answer limits, Prometheus metrics, the guards in front of
Serve's proxy and HAProxy, and ``serve_app.build_app``, which puts the deployments together."""
