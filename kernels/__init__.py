"""Hand-written CPU kernels that IREE links into its executables (kernels/q8_matmul.py)."""
