"""Checkpoint files for trainers: ``.npz`` archives of arrays plus a JSON ``meta`` entry.

`save_npz` writes atomically: a temporary file in the same directory, synced, then renamed over
the target (and the directory synced), so a crash or kill -9 mid-write leaves the previous
checkpoint intact.  `open_npz` turns every way a file can fail to be a checkpoint -- missing,
truncated, not a zip archive, pickled objects, no ``meta``, a damaged member -- into one
`CheckpointError` naming the file and what is wrong with it.  `Interval` says when a trainer's
periodic checkpoint (or durable point) is due.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
import zlib
from typing import Callable, Mapping

import numpy as np

from .errors import CachedArraysError

__all__ = ["CheckpointError", "CheckpointFile", "Interval", "check_writable", "open_npz", "save_npz"]

_BROKEN = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError)


class CheckpointError(CachedArraysError, ValueError):
    """A file is not a usable checkpoint; the message names the file and the problem."""


def check_writable(path: str) -> None:
    """Refuse early (before hours of training) a checkpoint path whose directory is missing or read-only."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot write checkpoint {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write checkpoint {path}: directory {directory} is not writable")
    if os.path.isdir(path):
        raise CheckpointError(f"cannot write checkpoint {path}: it is a directory")


def save_npz(path: str, arrays: Mapping[str, np.ndarray], meta: dict) -> str:
    """Write ``arrays`` and ``meta`` (JSON) to ``path`` atomically; returns ``path``."""
    if "meta" in arrays:
        raise ValueError("'meta' is reserved for the checkpoint's JSON metadata")
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _explain(e: BaseException) -> str:
    """What a numpy/zipfile error means for a checkpoint, in words."""
    text = f"{type(e).__name__}: {e}"
    if "pickle" in str(e).lower() or "object arrays" in str(e).lower():
        return f"it holds pickled Python objects, which a checkpoint never does ({text})"
    if isinstance(e, (zipfile.BadZipFile, EOFError, zlib.error)) or "zip" in str(e).lower():
        return f"it is not a complete .npz archive: truncated, damaged, or another kind of file ({text})"
    return f"it cannot be read ({text})"


class CheckpointFile:
    """An open checkpoint: ``meta`` (a dict), ``names``, and ``ck[name]`` reading one array."""

    def __init__(self, path: str, archive, meta: dict):
        self.path, self._z, self.meta = path, archive, meta

    @property
    def names(self) -> list[str]:
        return [n for n in self._z.files if n != "meta"]

    def __contains__(self, name: str) -> bool:
        return name in self._z.files and name != "meta"

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self:
            raise CheckpointError(f"checkpoint {self.path} has no array {name!r} (it has {', '.join(self.names[:12])})")
        try:
            return self._z[name]
        except _BROKEN as e:
            raise CheckpointError(f"checkpoint {self.path}: its array {name!r} cannot be read: {_explain(e)}") from None


def open_npz(path: str) -> "_Opened":
    """``with open_npz(path) as ck:`` -- a `CheckpointFile`, or `CheckpointError` if ``path`` is not one."""
    return _Opened(path)


class _Opened:
    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> CheckpointFile:
        path = self.path
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint {path} does not exist")
        with open(path, "rb") as f:
            head = f.read(6)
        if not head.startswith(b"PK"):
            kind = ("a single numpy array (.npy)" if head.startswith(b"\x93NUMPY") else
                    "a Python pickle" if head.startswith(b"\x80") else
                    "empty" if not head else f"not a zip archive (it starts with {head!r})")
            raise CheckpointError(f"{path} is not a checkpoint (an .npz archive): it is {kind}")
        try:
            self._z = np.load(path, allow_pickle=False)
        except _BROKEN as e:
            raise CheckpointError(f"{path} is not a checkpoint ({os.path.getsize(path)} bytes): {_explain(e)}") from None
        try:
            if "meta" not in self._z.files:
                raise CheckpointError(f"{path} is an .npz archive but not a checkpoint: it has no 'meta' entry "
                                      f"(it holds {', '.join(self._z.files[:12]) or 'nothing'})")
            try:
                raw = self._z["meta"]
                meta = json.loads(bytes(raw).decode())
            except _BROKEN + (UnicodeDecodeError,) as e:
                raise CheckpointError(f"{path} is not a checkpoint: its 'meta' entry is not JSON text "
                                      f"({type(e).__name__}: {e})") from None
            if not isinstance(meta, dict):
                raise CheckpointError(f"{path} is not a checkpoint: its 'meta' entry is not a JSON object")
        except BaseException:
            self._z.close()
            raise
        return CheckpointFile(path, self._z, meta)

    def __exit__(self, *exc) -> None:
        self._z.close()


class Interval:
    """When a periodic checkpoint is due: every ``steps`` steps and/or every ``minutes`` minutes (0: off).

    `due(step)` is asked after each step; `done()` restarts the clock after a checkpoint.
    """

    def __init__(self, steps: int = 0, minutes: float = 0.0, clock: Callable[[], float] = time.monotonic):
        if steps < 0 or minutes < 0:
            raise ValueError(f"checkpoint interval must not be negative, got {steps} steps / {minutes} minutes")
        self.steps, self.seconds, self.clock = int(steps), 60.0 * float(minutes), clock
        self.last = clock()

    @property
    def enabled(self) -> bool:
        return bool(self.steps or self.seconds)

    def due(self, step: int) -> bool:
        return bool((self.steps and step % self.steps == 0)
                    or (self.seconds and self.clock() - self.last >= self.seconds))

    def done(self) -> None:
        self.last = self.clock()
