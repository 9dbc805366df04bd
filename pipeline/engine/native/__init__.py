"""The engine's C kernels for the CPU (csrc/), built on first use and called through ctypes."""
