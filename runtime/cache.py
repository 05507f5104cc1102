"""The artifact cache: `<identity>.vmfb` plus a `<identity>.json` manifest per entry.

- Root: an explicit folder, else `$QWEN3VL_CACHE_DIR`, else `$XDG_CACHE_HOME/qwen3vl-iree`
  (default `~/.cache/qwen3vl-iree`).
- An entry is used only when its manifest parses, restates the identity and the fields
  (and the fields hash to the identity), and the vmfb's size and sha256 match it;
  otherwise the problem is reported (which file, why) and the entry is rebuilt.
- Writes are atomic: temp file in the same folder, fsync, `os.replace`; the vmfb first,
  the manifest last, so a manifest never describes a vmfb that is not there yet.
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


def _read_manifest(manifest_path: Path) -> dict:
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
    if not isinstance(manifest, dict) or not isinstance(manifest.get("vmfb"), dict):
        raise EntryProblem(f"{manifest_path}: manifest lacks the 'vmfb' record")
    return manifest


def check_vmfb(vmfb_path: Path, manifest: dict, manifest_path: Path) -> bytes:
    """The vmfb's bytes when its size and sha256 match the manifest."""
    try:
        data = vmfb_path.read_bytes()
    except FileNotFoundError:
        raise EntryProblem(f"{vmfb_path}: vmfb missing (its manifest {manifest_path.name} is there)") from None
    except OSError as e:
        raise EntryProblem(f"{vmfb_path}: vmfb unreadable ({e.strerror or e})") from None
    want_size, want_sha = manifest["vmfb"].get("size"), manifest["vmfb"].get("sha256")
    if len(data) != want_size:
        raise EntryProblem(f"{vmfb_path}: vmfb is {len(data)} bytes, manifest says {want_size}")
    got = sha256_bytes(data)
    if got != want_sha:
        raise EntryProblem(f"{vmfb_path}: vmfb sha256 {got[:16]}... does not match manifest's "
                           f"{str(want_sha)[:16]}...")
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

    def paths(self, identity: str) -> tuple[Path, Path, Path]:
        return (self.root / f"{identity}.vmfb", self.root / f"{identity}.json", self.root / f"{identity}.lock")

    def check(self, identity: str, fields: dict) -> Path:
        """The vmfb path when the entry checks out; EntryProblem (naming the file) if not."""
        vmfb_path, manifest_path, _ = self.paths(identity)
        manifest = _read_manifest(manifest_path)
        if manifest.get("identity") != identity:
            raise EntryProblem(f"{manifest_path}: manifest is for identity {manifest.get('identity')!r}")
        mfields = manifest.get("fields")
        if not isinstance(mfields, dict) or artifact_identity(mfields) != identity:
            raise EntryProblem(f"{manifest_path}: manifest fields do not hash to {identity[:12]}")
        if canonical_json(mfields) != canonical_json(fields):
            raise EntryProblem(f"{manifest_path}: manifest fields differ from the requested ones")
        check_vmfb(vmfb_path, manifest, manifest_path)
        return vmfb_path

    def lookup(self, fields: dict) -> Path | None:
        """The vmfb path when a good entry exists (no lock, no build, no report)."""
        try:
            return self.check(artifact_identity(fields), fields)
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
        for tmp in self.root.glob(f".{identity}.*.tmp"):
            tmp.unlink(missing_ok=True)

    def get_or_build(self, fields: dict, emit_fn: Callable[[], bytes],
                     progress: Callable[[str], None] | None = None) -> tuple[Path, bool]:
        """(vmfb path, built): reuse a checked-out entry, else call `emit_fn()` for the
        vmfb bytes (once across processes) and store it atomically."""
        report = progress or (lambda message: None)
        identity = artifact_identity(fields)
        self.ensure_root()
        vmfb_path, manifest_path, lock_path = self.paths(identity)
        try:  # fast path: a good entry needs no lock (files only ever appear whole)
            return self.check(identity, fields), False
        except EntryProblem:
            pass
        with self._locked(lock_path):
            try:
                return self.check(identity, fields), False  # built by another process meanwhile
            except EntryProblem as e:
                if vmfb_path.exists() or manifest_path.exists():
                    message = f"cache entry {identity[:12]} rejected: {e}; rebuilding"
                    log.warning(message)
                    report(message)
            self._remove_stale_temps(identity)
            manifest_path.unlink(missing_ok=True)  # never leave one describing a bad vmfb
            start = time.monotonic()
            data = emit_fn()
            if not isinstance(data, (bytes, bytearray)) or not data:
                raise CacheError(f"build of {identity[:12]} produced no vmfb bytes")
            data = bytes(data)
            seconds = time.monotonic() - start
            manifest = {
                "manifest_format": MANIFEST_FORMAT,
                "identity": identity,
                "fields": fields,
                "vmfb": {"file": vmfb_path.name, "sha256": sha256_bytes(data), "size": len(data)},
                "created": _now(),
                "build_seconds": round(seconds, 3),
            }
            try:
                write_atomic(vmfb_path, data)
                write_atomic(manifest_path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
            except OSError as e:
                manifest_path.unlink(missing_ok=True)
                raise CacheError(f"cache folder {self.root}: cannot write entry {identity[:12]} "
                                 f"({e.strerror or e}); expected a writable folder") from None
            return vmfb_path, True


def get_or_build(fields: dict, emit_fn: Callable[[], bytes], progress: Callable[[str], None] | None = None,
                 cache_dir: str | os.PathLike | None = None) -> tuple[Path, bool]:
    return ArtifactCache(cache_dir).get_or_build(fields, emit_fn, progress=progress)
