"""JSON Lines sink: one line per sampled step, crash-safe and size-bounded.

File format (schema 1)
----------------------
Each line is ``json.dumps({"schema": 1, **record.to_dict()})`` followed by ``"\\n"``: the
columnar :meth:`distgrad.record.StepRecord.to_dict` form plus a ``"schema"`` integer.
Non-finite floats use Python's ``NaN`` / ``Infinity`` / ``-Infinity`` literals, and every float is
written with ``repr`` precision, so :func:`read_jsonl` gives back records whose floats are
bit-identical to the ones written (NaN included).

Durability: each line is written with one ``write`` call and flushed to the OS right away
(optionally ``os.fsync``-ed), so a crash of the training process loses at most the line being
written; a torn last line is skipped by :func:`read_jsonl` and cut off when the sink re-opens the
file.

Rotation: when writing a line would make ``path`` exceed ``max_bytes``, ``path`` is renamed to
``path.1`` (``path.1`` to ``path.2``, ...; the oldest beyond ``backups`` is deleted) and a fresh
``path`` is started -- the scheme of :class:`logging.handlers.RotatingFileHandler`. Disk use is
therefore bounded by about ``(backups + 1) * max_bytes`` (one line may overshoot a file's bound
when that single line is larger than ``max_bytes``).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from distgrad.record import StepRecord
from distgrad.sinks.base import Sink

#: Version of the line format written by :class:`JsonlSink` (the ``"schema"`` key of each line).
SCHEMA_VERSION = 1

_DEFAULT_MAX_BYTES = 128 * 1024 * 1024
_DEFAULT_BACKUPS = 8


def _json_default(o: Any) -> Any:
    """Convert the numpy scalars/arrays that may hide in ``extra`` or ``counters``."""
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def encode_record(record: StepRecord) -> bytes:
    """One JSONL line (UTF-8, terminated by ``b"\\n"``) for ``record``.

    Raises:
        TypeError: if ``record.extra`` holds something JSON cannot represent.
    """
    d = {"schema": SCHEMA_VERSION}
    d.update(record.to_dict())
    return (json.dumps(d, separators=(",", ":"), allow_nan=True, default=_json_default) + "\n").encode("utf-8")


def decode_record(line: str | bytes) -> StepRecord:
    """Inverse of :func:`encode_record` for one line (with or without its newline).

    Raises:
        ValueError: on malformed JSON (``json.JSONDecodeError`` is a ValueError), a missing
            field, or a ``schema`` newer than :data:`SCHEMA_VERSION`.
    """
    d = json.loads(line)
    if not isinstance(d, dict):
        raise ValueError("JSONL line is not an object")
    schema = d.pop("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or schema > SCHEMA_VERSION:
        raise ValueError(f"unsupported distgrad JSONL schema {schema!r} (this reader knows <= {SCHEMA_VERSION})")
    try:
        return StepRecord.from_dict(d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a distgrad step record: {e!r}") from e


class JsonlSink(Sink):
    """Append every sampled step to a JSON Lines file, with size-bounded rotation.

    Args:
        path: file to append to (created with its parent directories; an existing file is
            appended to, after cutting off a torn last line left by a crash).
        max_bytes: rotate before a line would make ``path`` larger than this many bytes;
            ``None`` or ``0`` disables rotation. Default 128 MiB.
        backups: number of rotated files kept (``path.1`` newest ... ``path.N`` oldest); ``0``
            keeps none (the file is simply restarted when full). Default 8.
        fsync: also ``os.fsync`` after every line (survives an OS crash / power loss, costs a
            disk round trip per sampled step). Default False: flushed to the OS only, which
            survives a crash of the training process.

    Raises:
        ValueError: on a negative ``max_bytes`` or ``backups``.
        OSError: if the file cannot be opened.

    ``write`` raises ``ValueError`` after ``close``, ``TypeError`` for non-JSON ``extra`` contents
    and ``OSError`` on I/O errors (the caller counts and survives sink errors). Thread-safe.
    """

    name = "jsonl"

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int | None = _DEFAULT_MAX_BYTES,
        backups: int = _DEFAULT_BACKUPS,
        fsync: bool = False,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = Path(path)
        self.max_bytes = int(max_bytes or 0)
        self.backups = int(backups)
        self.fsync = bool(fsync)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        self._f = open(self.path, "ab")
        self._size = self._f.tell()
        self._closed = False

    def write(self, record: StepRecord) -> None:
        """Append ``record`` as one line, rotating first if the file would exceed ``max_bytes``."""
        line = encode_record(record)
        with self._lock:
            if self._closed:
                raise ValueError("JsonlSink is closed")
            if self.max_bytes and self._size > 0 and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._f.write(line)
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
            self._size += len(line)

    def _rotate(self) -> None:
        self._f.close()
        if self.backups > 0:
            base = str(self.path)
            oldest = Path(f"{base}.{self.backups}")
            if oldest.exists():
                oldest.unlink()
            for i in range(self.backups - 1, 0, -1):
                src = Path(f"{base}.{i}")
                if src.exists():
                    os.replace(src, f"{base}.{i + 1}")
            os.replace(self.path, f"{base}.1")
            self._f = open(self.path, "ab")
        else:
            self._f = open(self.path, "wb")
        if self.fsync:
            _fsync_dir(self.path.parent)
        self._size = 0

    def flush(self) -> None:
        """Force the file to stable storage (``os.fsync``), whatever the ``fsync`` option."""
        with self._lock:
            if not self._closed:
                self._f.flush()
                os.fsync(self._f.fileno())

    def close(self) -> None:
        """Flush and close the file; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._f.flush()
                if self.fsync:
                    os.fsync(self._f.fileno())
            finally:
                self._f.close()

    def __enter__(self) -> "JsonlSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that lacks its newline (a write torn by a crash) off ``path``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # scan back for the previous newline, in blocks
        pos = size
        block = 1 << 16
        keep = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)


_BACKUP_RE = re.compile(r"\.(\d+)$")


def rotated_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of a rotated JSONL log, oldest first: ``path.N``, ..., ``path.1``, ``path``.

    Every existing ``path.<integer>`` is included; ``path`` itself is included if it exists.
    """
    p = Path(path)
    backups: list[tuple[int, Path]] = []
    parent = p.parent if str(p.parent) else Path(".")
    if parent.is_dir():
        prefix = p.name + "."
        for q in parent.iterdir():
            if q.name.startswith(prefix):
                m = _BACKUP_RE.fullmatch(q.name[len(p.name):])
                if m and q.is_file():
                    backups.append((int(m.group(1)), q))
    files = [q for _, q in sorted(backups, key=lambda t: -t[0])]
    if p.is_file():
        files.append(p)
    return files


def read_jsonl(path: str | os.PathLike[str], include_rotated: bool = True,
               on_bad_line: "Callable[[str], None] | None" = None) -> Iterator[StepRecord]:
    """Stream the records of a JSONL run log, oldest first, one line in memory at a time.

    Args:
        path: the live file (``run.jsonl``); with ``include_rotated`` its rotated backups
            ``run.jsonl.N`` ... ``run.jsonl.1`` are read first, oldest first.
        include_rotated: read the rotated backups too (default True).
        on_bad_line: called with ``"file:line: error"`` for a malformed line in the middle of a
            file, which is then skipped; None (default) raises instead.

    Yields:
        :class:`~distgrad.record.StepRecord` per line, in file order. Blank lines are skipped.
        The last line of a file is skipped when it is torn (no trailing newline and not valid
        JSON), as left by a crash or by a writer still writing it.

    Raises:
        FileNotFoundError: if neither ``path`` nor any rotated backup exists.
        ValueError: on a malformed line that is not a torn last line (message names file and
            line number), or a newer schema.
    """
    files = rotated_files(path) if include_rotated else ([Path(path)] if Path(path).is_file() else [])
    if not files:
        raise FileNotFoundError(f"no JSONL run log at {os.fspath(path)!r}")
    for f in files:
        with open(f, "rb") as fh:
            lineno = 0
            for raw in fh:
                lineno += 1
                if not raw.strip():
                    continue
                try:
                    rec = decode_record(raw)
                except ValueError as e:
                    if not raw.endswith(b"\n"):
                        break  # torn last line (only the last line can lack its newline)
                    if on_bad_line is None:
                        raise ValueError(f"{f}:{lineno}: {e}") from e
                    on_bad_line(f"{f}:{lineno}: {e}")
                    continue
                yield rec
