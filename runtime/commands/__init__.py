"""The command line: `qwen3vl` and its commands (click), each over a library module."""
