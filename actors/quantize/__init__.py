"""The distributed quantize job on Ray: the driver (``quantize_job``), the stage actors and the session
that creates them, the pipelined calibration passes and the weight phase."""
