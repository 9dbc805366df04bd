"""Calibration: the calibration texts, the forwards that gather statistics (whole model or layer by layer),
msModelSlim's layer-by-layer passes with the arithmetic of DeepSeek's modeling code, the layer reads
that feed them, and the progress bars of a job's phases."""
