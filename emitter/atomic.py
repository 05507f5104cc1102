"""Whole files or nothing: every file this project writes goes through `write_atomic`.

The temp file sits beside the target as `.<name>.tmp.<pid>.<random>`: a writer killed
between writing and renaming (kill -9) leaves one behind, and the next write of the
same target removes it once its process is gone (a pid of this machine: a folder shared
between machines may hold another machine's live writer's temp, which it would remove)."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


class WriteError(OSError):
    """A write that failed, named by its target (never by the temp file)."""

    def __str__(self) -> str:
        return self.args[0]


def temp_prefix(path: Path) -> str:
    return f".{path.name}.tmp."


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(path: Path) -> None:
    """Remove temps of `path` (files, or folders of `folder_atomic`) left by writers that
    no longer run."""
    prefix = temp_prefix(path)
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split(".", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and not alive(int(pid)):
            stale = path.parent / name
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def _temp_name(path: Path) -> Path:
    """A free temp name beside `path` (`.<name>.tmp.<pid>.<random>`), not created."""
    fd, tmp = tempfile.mkstemp(prefix=f"{temp_prefix(path)}{os.getpid()}.", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)
    return Path(tmp)


def check_writable(path: str | os.PathLike, flag: str = "-o") -> Path:
    """Fail before any work if `path` cannot be written: its folder must exist, it must
    not be a folder or an existing non-regular file (a device is never replaced), and a
    probe file must be creatable, writable and syncable there now (so a read-only or
    full filesystem fails here, not after the work). Returns the resolved path."""
    target = Path(path).expanduser()
    parent = target.absolute().parent  # a symlink is replaced, not written through
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; expected a file name")
    if target.exists() and not target.is_file():  # /dev/null, a FIFO: the rename would replace it
        raise ValueError(f"{flag} {path}: not a regular file; expected a file name")
    if not parent.exists():
        raise ValueError(f"{flag} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder")
    probe = None
    try:
        fd, probe = tempfile.mkstemp(prefix=f"{temp_prefix(target)}{os.getpid()}.", dir=parent)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in folder {parent}: {e.strerror or e}") from None
    finally:
        if probe:
            Path(probe).unlink(missing_ok=True)
    return target.resolve()


def write_atomic(path: str | os.PathLike, data: str | bytes, mode: int = 0o644) -> None:
    """Write a temp file beside `path`, fsync it, rename it over `path`; on any error the
    temp is removed, `path` is untouched, and the error (WriteError) names `path`."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    remove_stale_temps(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{temp_prefix(path)}{os.getpid()}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # mkstemp makes 0600
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            reason = "is a folder" if path.is_dir() else (e.strerror or str(e))
            raise WriteError(f"cannot write {path}: {reason}") from None
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def link_atomic(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """`path` becomes a file with `source`'s content, whole or not at all: a hard link when
    they share a file system (for a source never rewritten in place, such as a cache
    entry), else a copy. Nothing is done, and no temp left, when `path` already is
    `source` (a rename onto the same file does nothing and would leave the temp)."""
    source, path = Path(source), Path(path)
    remove_stale_temps(path)
    if path.is_file() and os.path.samefile(source, path):
        return
    tmp = _temp_name(path)
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def folder_atomic(folder: str | os.PathLike, replace: bool = False):
    """Yield a new temp folder beside `folder` to fill; when the block ends without an
    error it becomes `folder` whole: renamed onto a missing or empty folder, or with
    `replace`, swapped for the folder there, which is then removed (a kill between the two
    renames leaves no `folder`, never a mix). On an error the temp folder is removed and
    any earlier folder kept; a killed writer's temps go at the next `folder_atomic` of the
    same folder."""
    folder = Path(folder)
    remove_stale_temps(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f"{temp_prefix(folder)}{os.getpid()}.", dir=folder.parent))
    old = None
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        if replace and folder.is_dir() and os.listdir(folder):
            old = _temp_name(folder)
            os.replace(folder, old)
        os.replace(tmp, folder)
    except BaseException:
        if old is not None and old.exists() and not folder.exists():
            os.replace(old, folder)  # the earlier folder back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
