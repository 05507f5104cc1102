"""Hand-written CPU kernels that IREE links into its executables: the C sources, building their
objects (kernels/build.py), their weight layouts and their arithmetic in numpy (kernels/q8_matmul.py,
kernels/decode_attention.py). Imports nothing of `emitter` or `runtime`: emitter/kernel_calls.py
emits the calls into a graph."""
