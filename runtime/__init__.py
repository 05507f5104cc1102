"""Runs the emitted Qwen3-VL on IREE, the whole model: the vision tower (`vision`) and the language
model (`text`: prefill, decode, generate), over the artifact cache (`artifact`), and the `qwen3vl`
commands (`commands`): generate, serve (`serve`), run and embed (`jobs`), export, oracle (`oracle`)
and bench (`bench`); checkpoints (Hugging Face, MLX, GGUF: `checkpoints`) and inputs (`inputs`)."""
