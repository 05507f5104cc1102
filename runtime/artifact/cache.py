"""The artifact cache: `<identity>.<kind>` plus a `<identity>.json` manifest per entry;
kind `vmfb` (the compiled module, identity from `emitter.identity`) or `irpa` (the weight
archive, identity from its content: `runtime.artifact.archive`).

- Root: an explicit folder, else `$QWEN3VL_CACHE_DIR`, else `$XDG_CACHE_HOME/qwen3vl-iree`
  (default `~/.cache/qwen3vl-iree`).
- An entry is used only when its manifest parses, restates the identity and the fields
  (and the fields hash to the identity), and the file's size and sha256 match it;
  otherwise the problem is reported once (which file, why) and the entry is rebuilt.
- Writes are atomic: temp file in the same folder, fsync, `os.replace`; the file first,
  the manifest last, so a manifest never describes a file that is not there yet; if the
  manifest cannot be written (full disk) the file is removed too.
- Concurrent builds of one identity compile once: an exclusive `flock` on
  `<identity>.lock`, and a re-check after it is acquired.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from emitter.atomic import write_atomic
from emitter.identity import artifact_identity, canonical_json

log = logging.getLogger(__name__)

CACHE_ENV = "QWEN3VL_CACHE_DIR"
APP_NAME = "qwen3vl-iree"
MANIFEST_FORMAT = 1


class CacheError(OSError):
    """The cache folder cannot be used, or an artifact does not check out."""


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / APP_NAME


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class EntryProblem(Exception):
    """Why an existing entry cannot be used (message names the file)."""


def _read_manifest(manifest_path: Path, kind: str = "vmfb") -> dict:
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EntryProblem(f"{manifest_path}: manifest missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EntryProblem(f"{manifest_path}: manifest unreadable ({e})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise EntryProblem(f"{manifest_path}: manifest is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get(kind), dict):
        raise EntryProblem(f"{manifest_path}: manifest lacks the '{kind}' record")
    return manifest


def file_sha256(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, read in chunks (archives are gigabytes)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _check_record(path: Path, record: dict, size: int, sha: str, kind: str) -> None:
    want_size, want_sha = record.get("size"), record.get("sha256")
    if size != want_size:
        raise EntryProblem(f"{path}: {kind} is {size} bytes, manifest says {want_size}")
    if sha != want_sha:
        raise EntryProblem(f"{path}: {kind} sha256 {sha[:16]}... does not match manifest's {str(want_sha)[:16]}...")


def check_file(path: Path, manifest: dict, manifest_path: Path, kind: str) -> None:
    """Size and sha256 of the entry's file against its manifest record."""
    try:
        size, sha = file_sha256(path)
    except FileNotFoundError:
        raise EntryProblem(f"{path}: {kind} missing (its manifest {manifest_path.name} is there)") from None
    except OSError as e:
        raise EntryProblem(f"{path}: {kind} unreadable ({e.strerror or e})") from None
    _check_record(path, manifest[kind], size, sha, kind)


def check_vmfb(vmfb_path: Path, manifest: dict, manifest_path: Path) -> bytes:
    """The vmfb's bytes when its size and sha256 match the manifest."""
    try:
        data = vmfb_path.read_bytes()
    except FileNotFoundError:
        raise EntryProblem(f"{vmfb_path}: vmfb missing (its manifest {manifest_path.name} is there)") from None
    except OSError as e:
        raise EntryProblem(f"{vmfb_path}: vmfb unreadable ({e.strerror or e})") from None
    _check_record(vmfb_path, manifest["vmfb"], len(data), sha256_bytes(data), "vmfb")
    return data


def load_verified(path: str | os.PathLike) -> bytes:
    """The bytes of a cached vmfb, re-checked against its manifest's sha256 right before
    they are handed to the loader. Raises CacheError when they do not check out."""
    path = Path(path)
    manifest_path = path.with_suffix(".json")
    try:
        manifest = _read_manifest(manifest_path)
        if manifest.get("identity") != path.stem:
            raise EntryProblem(f"{manifest_path}: manifest is for identity {manifest.get('identity')!r}")
        return check_vmfb(path, manifest, manifest_path)
    except EntryProblem as e:
        raise CacheError(f"cache entry does not check out: {e}") from None


class ArtifactCache:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root else default_cache_root()

    def ensure_root(self) -> Path:
        """Create the root folder if needed; a CacheError naming it if that fails."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"cache folder {self.root}: cannot create it ({e.strerror or e}); "
                             f"expected a writable folder (--cache-dir or ${CACHE_ENV})") from None
        if not self.root.is_dir():
            raise CacheError(f"cache folder {self.root}: not a folder; expected a writable folder")
        return self.root

    def paths(self, identity: str, kind: str = "vmfb") -> tuple[Path, Path, Path]:
        return (self.root / f"{identity}.{kind}", self.root / f"{identity}.json", self.root / f"{identity}.lock")

    def check(self, identity: str, fields: dict, kind: str = "vmfb") -> Path:
        """The entry's file when it checks out; EntryProblem (naming the file) if not."""
        path, manifest_path, _ = self.paths(identity, kind)
        manifest = _read_manifest(manifest_path, kind)
        if manifest.get("identity") != identity:
            raise EntryProblem(f"{manifest_path}: manifest is for identity {manifest.get('identity')!r}")
        mfields = manifest.get("fields")
        if not isinstance(mfields, dict) or artifact_identity(mfields) != identity:
            raise EntryProblem(f"{manifest_path}: manifest fields do not hash to {identity[:12]}")
        if canonical_json(mfields) != canonical_json(fields):
            raise EntryProblem(f"{manifest_path}: manifest fields differ from the requested ones")
        check_file(path, manifest, manifest_path, kind)
        return path

    def lookup(self, fields: dict, kind: str = "vmfb") -> Path | None:
        """The entry's file when a good entry exists (no lock, no build, no report)."""
        try:
            return self.check(artifact_identity(fields), fields, kind)
        except EntryProblem:
            return None

    @contextmanager
    def _locked(self, lock_path: Path):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CacheError(f"cache folder {self.root}: cannot write {lock_path.name} "
                             f"({e.strerror or e}); expected a writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _remove_stale_temps(self, identity: str) -> None:
        # Under the identity's lock only this process writes its files: any temp
        # left is from a process that died mid-write.
        for tmp in self.root.glob(f".{identity}.*"):
            tmp.unlink(missing_ok=True)

    def get_or_build(self, fields: dict, emit_fn: Callable[[], bytes],
                     progress: Callable[[str], None] | None = None) -> tuple[Path, bool]:
        """(vmfb path, built): reuse a checked-out entry, else call `emit_fn()` for the
        vmfb bytes (once across processes) and store it atomically."""
        def write(path: Path) -> None:
            data = emit_fn()
            if not isinstance(data, (bytes, bytearray)) or not data:
                raise CacheError(f"build of {path.stem[:12]} produced no vmfb bytes")
            write_atomic(path, bytes(data))
        return self.get_or_write(fields, "vmfb", write, progress)

    def get_or_write(self, fields: dict, kind: str, write_fn: Callable[[Path], None],
                     progress: Callable[[str], None] | None = None) -> tuple[Path, bool]:
        """(path, built) of the `<identity>.<kind>` entry: reuse a checked-out one, else
        call `write_fn(path)` (once across processes), which writes the file whole or not
        at all, then record its size and sha256 in the manifest."""
        identity = artifact_identity(fields)
        self.ensure_root()
        path, manifest_path, lock_path = self.paths(identity, kind)
        try:  # fast path: a good entry needs no lock (files only ever appear whole)
            return self.check(identity, fields, kind), False
        except EntryProblem:
            pass
        with self._locked(lock_path):
            try:
                return self.check(identity, fields, kind), False  # built by another process meanwhile
            except EntryProblem as e:
                if path.exists() or manifest_path.exists():
                    message = f"cache entry {identity[:12]} rejected: {e}; rebuilding"
                    (progress or log.warning)(message)  # once: to the caller if it listens, else the log
            self._remove_stale_temps(identity)
            manifest_path.unlink(missing_ok=True)  # never leave one describing a bad file
            start = time.monotonic()
            try:
                write_fn(path)
                size, sha = file_sha256(path)
                manifest = {
                    "manifest_format": MANIFEST_FORMAT,
                    "identity": identity,
                    "fields": fields,
                    kind: {"file": path.name, "sha256": sha, "size": size},
                    "created": _now(),
                    "build_seconds": round(time.monotonic() - start, 3),
                }
                write_atomic(manifest_path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
            except BaseException as e:
                path.unlink(missing_ok=True)  # a file without a manifest only holds space
                manifest_path.unlink(missing_ok=True)
                if isinstance(e, OSError) and not isinstance(e, CacheError):
                    raise CacheError(f"cache folder {self.root}: cannot write entry {identity[:12]} "
                                     f"({e.strerror or e}); expected a writable folder") from None
                raise
            return path, True


def get_or_build(fields: dict, emit_fn: Callable[[], bytes], progress: Callable[[str], None] | None = None,
                 cache_dir: str | os.PathLike | None = None) -> tuple[Path, bool]:
    return ArtifactCache(cache_dir).get_or_build(fields, emit_fn, progress=progress)
