"""One renderer for every emitted module: a header comment, the module's globals, then each
function (name, arguments, results, body lines from its builder), in `module.mlir.j2`."""

from __future__ import annotations

from importlib import resources

import jinja2

from .builder import Builder, Value


def _template() -> jinja2.Template:
    text = resources.files("qwen3vl_templates").joinpath("module.mlir.j2").read_text()
    env = jinja2.Environment(keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined)
    return env.from_string(text)


def function(b: Builder, name: str, results: list[tuple[str, Value]]) -> dict:
    """A builder's arguments and lines as function `name` returning `results` (ABI name, value)."""
    return {"name": name, "arguments": b.arguments, "results": results, "body": b.lines}


def render(module_name: str, header: str, globals_: list[str], functions: list[dict]) -> str:
    """The module's MLIR text: `header` (comment lines, each ending in a newline), then
    `module @<module_name>` holding the globals and the functions."""
    return _template().render(module=module_name, header=header, globals=globals_, functions=functions)
