"""A compiled module loaded on an IREE device, with arrays kept resident."""

from __future__ import annotations

import numpy as np
import iree.runtime as rt


class LoadedModule:
    """One vmfb in its own context. `upload` makes device arrays once; `__call__` takes
    device arrays or numpy arrays (positional, in argument order) and returns numpy copies."""

    def __init__(self, vmfb: bytes, driver: str = "local-task", function: str = "main",
                 module_name: str = "qwen3vl_vision", config: rt.Config | None = None, modules=()):
        # Modules sharing one config share its device, so one upload of the weights serves all.
        self.config = config or rt.Config(driver)
        self.context = rt.SystemContext(config=self.config)
        for module in modules:  # e.g. the parameter provider, before the module that needs it
            self.context.add_vm_module(module)
        self._vmfb = vmfb  # the module maps this buffer: keep it alive
        self.context.add_vm_module(rt.VmModule.copy_buffer(self.config.vm_instance, vmfb))
        self.function = self.context.modules[module_name][function]

    def upload(self, array: np.ndarray):
        return rt.asdevicearray(self.config.device, np.asarray(array, order="C"))

    def __call__(self, *args) -> list[np.ndarray]:
        results = self.function(*args)
        if not isinstance(results, (list, tuple)):
            results = [results]
        # to_host() is a view a later call may overwrite: copy.
        return [np.array(r.to_host(), copy=True) for r in results]


def parameters_module(config: rt.Config, named_arrays, scope: str = "model") -> rt.VmModule:
    """An `io_parameters` module serving `(name, array)` pairs under `scope`; the arrays
    are referenced, not copied, and must stay alive as long as the module."""
    index = rt.ParameterIndex()
    for name, array in named_arrays:  # raw bytes: the module knows each global's type (bf16 too)
        index.add_buffer(name, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=scope))
