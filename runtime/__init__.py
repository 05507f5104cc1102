"""Runs emitted Qwen3-VL vision artifacts on IREE: processor, checkpoints, cache, session."""
