"""The transforms applied to the float weights before quantization: SmoothQuant smoothing, msModelSlim's
iterative and flex smoothing over their subgraphs, QuaRot rotations (Hadamard matrices), the outlier
statistics they measure, and the recipe resolved for a model into the plan of steps the job follows
(``recipe_plan``: what each step runs on, folds in and adds to the output)."""
