"""Checkpoint folders: the Hugging Face and MLX readers (vision and text), and the writers of random
checkpoints for demos and tests."""
