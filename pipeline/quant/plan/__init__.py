"""Planning a distributed quantization job from the source's headers alone (unit costs from
:mod:`pipeline.quant.job.costs`): the balanced stage partition, shards per stage, per-actor memory, the
resource check and the wall-time estimate. Modules: ``types`` (the plan's data), ``planner`` (``plan()``),
``partition``, ``memory``, ``resources``, ``report``, ``timing``."""
