"""The transforms applied to the float weights before quantization: SmoothQuant smoothing, msModelSlim's
iterative and flex smoothing over their subgraphs, QuaRot rotations (Hadamard matrices), the tensors the
steps add to the output, and the outlier statistics they measure."""
