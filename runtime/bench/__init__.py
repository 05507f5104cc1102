"""Benchmarks that ship with the package: the vision tower against transformers and the machine's roof,
and the bf16 forms."""
