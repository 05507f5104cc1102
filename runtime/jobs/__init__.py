"""Jobs over many inputs: `qwen3vl run` and `qwen3vl embed` (local or on Ray Data)."""
