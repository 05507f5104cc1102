"""Checkpoints: the Hugging Face and MLX readers (vision and text), the GGUF readers (llama.cpp's text
file and its mmproj), and the writers of random checkpoints for demos and tests."""
