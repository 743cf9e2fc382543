"""Quantized weights and KV cache: checkpoint formats, the quantized linear modules that replace
the model's own from outside it, and the packed layouts their kernels read."""
