"""Planning a distributed quantization job from the source's headers alone: per-unit costs, the balanced
stage partition, shards per stage, per-actor memory, the resource check, the wall-time estimate, and a
header-only replica of the 671B release to plan against. Modules: ``types`` (the plan's data),
``planner`` (``plan()``), ``costs``, ``partition``, ``memory``, ``resources``, ``report``, ``timing``,
``replica``."""
