"""The measured fallback (``--fa-fallback`` / ``--linear-fallback``): each quantized piece climbs a ladder
toward the model dtype by measurement, the fewest bytes above int8 that meet an accuracy target.

    job     the job's flags, the probe, the measurement and the pick, the amended recipe (module doc)
    rungs   the pieces (fused pairs together, one routed expert at a time), their rungs W8A8 ->
            W8A8_DYNAMIC -> FLOAT, the bytes each keeps above int8, the recipe a pick writes
    search  each piece's cost per rung, the moves by error reduction per byte, the search validated on
            held-out calibration samples
    share   the share of linear weights a written output keeps above int8
    smoothing  the zero-byte step before the ladder: MLP input smoothing, kept where it lowers the error

The job's names are exported here.
"""

from pipeline.quant.evaluation.fallback.job import (AUTO, PROBE_TAG, REPORT_NAME, TARGET, TARGET_KEYS, Choice,
                                                    FloatWeights, check_choices, choose, fallback_groups,
                                                    parse_choice, parse_target, pieces, probe_path,
                                                    quantize_with_fallback, sweep_probes, target_text,
                                                    with_fallback)

__all__ = ["AUTO", "PROBE_TAG", "REPORT_NAME", "TARGET", "TARGET_KEYS", "Choice", "FloatWeights", "check_choices",
           "choose", "fallback_groups", "parse_choice", "parse_target", "pieces", "probe_path",
           "quantize_with_fallback", "sweep_probes", "target_text", "with_fallback"]
