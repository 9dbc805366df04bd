"""What a quantize job computes: the :class:`~pipeline.quant.recipe.recipe.Recipe`, read from msModelSlim's
YAML (``modelslim_yaml``), a preset (``presets``, files in ``presets/``) or flags (``recipe_source``); its
linear rules, name patterns and anti-outlier steps."""
