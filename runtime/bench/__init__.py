"""Benchmarks that ship with the package: the vision tower against transformers and the machine's roof,
each precision's forms, a decode step under IREE's profiler, llama.cpp's GGUF converter and the memory of
an MLX-quantized model."""
