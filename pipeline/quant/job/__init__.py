"""A quantize job end to end (``run.quantize_checkpoint``): its options, the checks before any work, the
up-front estimate and unit costs, a pipeline stage of the float model, the resumable job state and the
calibration statistics on storage."""
