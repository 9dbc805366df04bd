"""The engine core: what runs where, decided without touching a tensor (the scheduler and the request
state), sampling, and the engine that joins them with a model runner, stepped by a loop on its own thread or
in its own process."""
