"""What every command checks of its outputs, in one place: before any work, that a file or
folder it will write can be written and overwrites no input; after the work, that the
numbers it would write are finite."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from emitter.atomic import check_writable


def check_output_path(path, model, inputs=(), flag: str = "-o") -> Path:
    """Fail before any work if `path` cannot be written (`check_writable`) or would
    overwrite an input: an image or video, or a file of the checkpoint folder (a new
    *.safetensors there would be read as part of the checkpoint). Returns it resolved."""
    target = check_writable(path, flag)
    for source in inputs:
        if Path(source).resolve() == target:
            raise ValueError(f"{flag} {path}: is the input image or video {source}; choose another file")
    if model and target.parent == Path(model).resolve() and (target.exists() or target.suffix == ".safetensors"):
        raise ValueError(f"{flag} {path}: would write into the checkpoint folder {model} "
                         f"({'replacing its file' if target.exists() else 'as a weight file'}); choose another folder")
    return target


def check_output_paths(outputs: dict[str, str | None], model, inputs=()) -> None:
    """`check_output_path` for each given {flag: path}, and no two flags naming one file
    (the second write would replace the first)."""
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if not path:
            continue
        target = check_output_path(path, model, inputs, flag)
        if target in seen:
            raise ValueError(f"{flag} {path}: the same file as {seen[target]}; give each output its own file")
        seen[target] = flag


def check_output_folder(path, model, flag: str = "-o") -> Path:
    """A folder to write into (created if missing): not a file, its parent an existing
    folder, and not the checkpoint folder (its files would be read as the checkpoint's).
    Returns it, not yet created."""
    folder = Path(path).expanduser()
    parent = folder.absolute().parent
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {path}: is a file; expected a folder (created if missing)")
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder; expected a folder inside a folder")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {parent} does not exist")
    if model and (folder.absolute() == Path(model).absolute()
                  or (folder.exists() and folder.resolve() == Path(model).resolve())):
        raise ValueError(f"{flag} {path}: is the checkpoint folder (what is written there would be read as "
                         f"part of the checkpoint); choose another folder")
    return folder


class NonFiniteError(ValueError):
    """A model's output holds NaN or inf: the model overflowed, not the input's fault."""


def check_finite(name: str, value: np.ndarray, cause: str) -> None:
    """NaN or inf in an output means the model overflowed: NonFiniteError (a ValueError)
    naming the output, how many values, and `cause` (what overflowed)."""
    bad = value.size - int(np.count_nonzero(np.isfinite(value)))
    if bad:
        raise NonFiniteError(f"output {name}: {bad} of {value.size} values are NaN or inf; {cause} overflowed "
                             f"f32 (check the checkpoint's weights)")
