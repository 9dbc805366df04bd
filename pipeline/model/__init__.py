"""The float DeepSeek-V3/R1 model in torch: MLA (naive and absorbed), MoE with the noaux_tc router, MTP.

Module names follow the HF checkpoint, so ``state_dict()`` keys are the checkpoint's tensor names.
"""

from pipeline.model.cache import LatentCache, ModelCache
from pipeline.model.causal_lm import DeepseekV3ForCausalLM, build_model

__all__ = ["DeepseekV3ForCausalLM", "LatentCache", "ModelCache", "build_model"]
