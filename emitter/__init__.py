"""Emits the Qwen3-VL vision tower as StableHLO MLIR text (never imports `runtime`)."""

__version__ = "0.1.0"
