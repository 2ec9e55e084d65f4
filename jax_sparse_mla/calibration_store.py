"""The calibration file: measured cost-model constants per device, stored as JSON.

The file lives at ``$JAX_SPARSE_MLA_CACHE_DIR/calibration.json`` (default
``$XDG_CACHE_HOME/jax_sparse_mla`` or ``~/.cache/jax_sparse_mla``) and holds, per device name, the
constants of :class:`jax_sparse_mla.planner.CostModel` that
:func:`jax_sparse_mla.calibration.calibrate` measured. The planner reads it here; measuring lives
in :mod:`jax_sparse_mla.calibration`, which sits above the planner.

- Writes are atomic (a temporary file in the same directory, then ``os.replace``) and serialised with
  an exclusive ``fcntl`` lock on a sibling ``.lock`` file, so concurrent calibrations never corrupt it.
- Reads are cheap: the file is parsed only when its change token (inode, size, mtime) differs from the
  last one seen. A file with an unknown or old schema, or one that does not parse, is ignored and its
  token remembered as stale, so it is not re-parsed on every trace; a changed file is read again.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import tempfile
import threading
from typing import Optional

__all__ = ["SCHEMA_VERSION", "ENV_CACHE_DIR", "cache_dir", "calibration_path", "load", "device_constants",
           "store"]

#: Version of the file layout and of the constants' meaning; other versions are ignored.
SCHEMA_VERSION = 2
#: Environment variable overriding the directory of the calibration file.
ENV_CACHE_DIR = "JAX_SPARSE_MLA_CACHE_DIR"
_FILE_NAME = "calibration.json"

_lock = threading.Lock()
_cache: dict = {"path": None, "token": None, "devices": {}}


def cache_dir() -> pathlib.Path:
    """The directory of the calibration file (see the module docstring)."""
    override = os.environ.get(ENV_CACHE_DIR)
    if override:
        return pathlib.Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jax_sparse_mla"


def calibration_path() -> pathlib.Path:
    """The calibration file's path."""
    return cache_dir() / _FILE_NAME


def _change_token(path: pathlib.Path):
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _parse(text: str) -> Optional[dict]:
    """The per-device entries of a file's text, or None when it is not a current-schema file."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION or not isinstance(data.get("devices"), dict):
        return None
    return data["devices"]


def load(path: Optional[pathlib.Path] = None) -> dict:
    """Per-device entries of the calibration file (empty when missing, corrupt or of another schema).

    Parses the file only when its change token differs from the last one seen.
    """
    path = pathlib.Path(path) if path is not None else calibration_path()
    token = _change_token(path)
    with _lock:
        if _cache["path"] == path and _cache["token"] == token:
            return _cache["devices"]
    devices = {}
    if token is not None:
        try:
            devices = _parse(path.read_text()) or {}
        except OSError:
            devices = {}
    with _lock:
        _cache.update(path=path, token=token, devices=devices)
    return devices


def device_constants(device_name: str, path: Optional[pathlib.Path] = None) -> Optional[dict]:
    """The calibrated constants of ``device_name``, or None when it was never calibrated."""
    entry = load(path).get(device_name)
    return None if entry is None else entry.get("constants")


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def store(device_name: str, constants: dict, path: Optional[pathlib.Path] = None, **metadata) -> None:
    """Atomically records ``constants`` for ``device_name``, keeping other devices' entries.

    An existing file of another schema (or a corrupt one) is replaced by a current-schema file.
    """
    path = pathlib.Path(path) if path is not None else calibration_path()
    with _file_lock(path):
        devices = {}
        if path.exists():
            devices = _parse(path.read_text()) or {}
        devices[device_name] = {
            "constants": constants,
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **metadata,
        }
        payload = json.dumps({"schema": SCHEMA_VERSION, "devices": devices}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(prefix=".calibration.", dir=str(path.parent))
        try:
            with os.fdopen(fd, "w") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
