"""Ray actors and Serve deployments, thin wrappers over pipeline/: ``cluster`` (starting Ray, its errors,
the reaper of a private Ray), ``quantize`` (the distributed quantize job's driver and stage actors) and
``serving`` (the Ray Serve application: its configuration, the engine deployments and the HTTP side)."""
