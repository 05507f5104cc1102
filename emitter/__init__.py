"""Emits Qwen3-VL as StableHLO MLIR text, the whole model: the vision tower with its DeepStack
features, and the language model (prefill and decode over a paged KV cache). Never imports `runtime`."""

__version__ = "0.1.0"
