"""Compiled artifacts: iree-compile, the content-addressed cache, the build of a module, the weight
archive, module loading on a device, and the exported folder."""
