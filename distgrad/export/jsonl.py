"""JSON Lines sink: one line per sampled step, crash-safe and size-bounded.

File format (schema 2)
----------------------
Each line is ``json.dumps({"schema": 2, **record.to_dict()})`` followed by ``"\\n"``: the
columnar :meth:`distgrad.record.StepRecord.to_dict` form (the diagnostics as typed parts:
``"spikes"``, ``"health"``, ...) plus a ``"schema"`` integer (:data:`SCHEMA_VERSION`).
Non-finite floats use Python's ``NaN`` / ``Infinity`` / ``-Infinity`` literals, and every float is
written with ``repr`` precision, so :func:`read_jsonl` gives back records whose floats are
bit-identical to the ones written (NaN included).

Durability: each line is written whole with one ``os.write`` on an ``O_APPEND`` descriptor, so
it reaches the OS right away (optionally ``os.fsync``-ed) and a crash of the training process
loses at most the line being written; a torn last line is skipped by :func:`read_jsonl` and cut
off when the sink re-opens the file. A failed write (disk full) is cut back off the file, or, if
that fails too, ended by a newline before the next line, so a torn line never merges with a
good one. The sink re-opens its file when the path disappears and retries failures with
back-off; every record it loses is counted (see :class:`JsonlSink`).

Rotation: when writing a line would make ``path`` exceed ``max_bytes``, ``path`` is renamed to
``path.1`` (``path.1`` to ``path.2``, ...; the oldest beyond ``backups`` is deleted) and a fresh
``path`` is started -- the scheme of :class:`logging.handlers.RotatingFileHandler`. Disk use is
therefore bounded by about ``(backups + 1) * max_bytes`` (one line may overshoot a file's bound
when that single line is larger than ``max_bytes``; a rotation that fails is retried later,
the file growing meanwhile).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.config.sections import JsonlConfig
from distgrad.export.base import Sink, SinkError
from distgrad.record import StepRecord

log = logging.getLogger("distgrad")

#: Version of the line format written by :class:`JsonlSink` (the ``"schema"`` key of each line):
#: 2, the diagnostics as typed parts (``"spikes"``, ``"health"``, ...). The only version read.
SCHEMA_VERSION = 2

# the configuration's defaults (``sinks.jsonl``): one default per setting
_DEFAULT_MAX_BYTES = JsonlConfig().max_bytes
_DEFAULT_BACKUPS = JsonlConfig().backups


def _json_default(o: Any) -> Any:
    """Convert the numpy scalars/arrays that may hide in the record's parts or ``counters``."""
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
        TypeError: if a field holds something JSON cannot represent.
    """
    d = {"schema": SCHEMA_VERSION}
    d.update(record.to_dict())
    return (json.dumps(d, separators=(",", ":"), allow_nan=True, default=_json_default) + "\n").encode("utf-8")


def decode_record(line: str | bytes) -> StepRecord:
    """Inverse of :func:`encode_record` for one line (with or without its newline).

    Raises:
        ValueError: on malformed JSON (``json.JSONDecodeError`` is a ValueError), a missing
            field, or a ``schema`` other than :data:`SCHEMA_VERSION`.
    """
    d = json.loads(line)
    if not isinstance(d, dict):
        raise ValueError("JSONL line is not an object")
    schema = d.pop("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or schema != SCHEMA_VERSION:
        raise ValueError(f"unsupported distgrad JSONL schema {schema!r} (this reader knows {SCHEMA_VERSION})")
    try:
        return StepRecord.from_dict(d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a distgrad step record: {e!r}") from e


class JsonlSink(Sink):
    """Append every sampled step to a JSON Lines file, with size-bounded rotation; crash-safe and
    self-healing.

    Args:
        path: file to append to (created with its parent directories; an existing file is
            appended to, after cutting off a torn last line left by a crash).
        max_bytes: rotate before a line would make ``path`` larger than this many bytes;
            ``None`` or ``0`` disables rotation. Default: ``sinks.jsonl.max_bytes``'s (128 MiB).
        backups: number of rotated files kept (``path.1`` newest ... ``path.N`` oldest); ``0``
            keeps none (the file is simply restarted when full). Default: ``sinks.jsonl.backups``'s
            (8).
        fsync: also ``os.fsync`` after every line (survives an OS crash / power loss, costs a
            disk round trip per sampled step). Default False: flushed to the OS only, which
            survives a crash of the training process.
        retry_min_s, retry_max_s: back-off after a failure (seconds): the first retry is
            ``retry_min_s`` after the failure, each further failure doubles the wait, up to
            ``retry_max_s``. Records arriving while the sink waits are lost (and counted).

    Raises:
        ValueError: on a negative ``max_bytes``, ``backups`` or retry delay.
        OSError: if the file cannot be opened (at construction only).

    Whole lines only: each line is built in memory and written with ``os.write`` on an
    ``O_APPEND`` descriptor; a short or failed write (disk full) is cut back off the file
    (``ftruncate`` to where the line started), and if even that fails, the next line written
    starts with a newline, so a torn fragment never merges with a good line (readers skip it as
    one malformed line).

    Self-healing: before each line the sink compares the inode of ``path`` with its open file's
    (two ``stat`` calls); when ``path`` was deleted, replaced or renamed away (its directory
    removed, an external ``logrotate``), the sink re-creates the directory and re-opens
    ``path``, so no record goes to an unlinked file. After a failed open, write or rotation it
    closes the file and re-opens it at the next line due after the back-off delay.

    Losses: ``write`` raises :class:`~distgrad.export.base.SinkError` (an ``OSError``) exactly
    when the record was not written: the instrument counts each in
    ``distgrad_sink_errors_total{sink="jsonl"}``, so that counter equals the records lost, also
    available as :attr:`lost_records`. Each failure kind (open, write, rotate, path vanished) is
    logged once, without a traceback, until the sink recovers; the recovery is logged with the
    number and step range of the records lost. ``write`` raises ``ValueError`` after ``close``
    and ``TypeError`` for non-JSON field contents. Thread-safe.
    """

    name = "jsonl"

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int | None = _DEFAULT_MAX_BYTES,
        backups: int = _DEFAULT_BACKUPS,
        fsync: bool = False,
        retry_min_s: float = 1.0,
        retry_max_s: float = 60.0,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        if not 0 <= retry_min_s <= retry_max_s:
            raise ValueError(f"need 0 <= retry_min_s <= retry_max_s, got {retry_min_s}, {retry_max_s}")
        self.path = Path(path)
        self.max_bytes = int(max_bytes or 0)
        self.backups = int(backups)
        self.fsync = bool(fsync)
        self.retry_min_s, self.retry_max_s = float(retry_min_s), float(retry_max_s)
        #: records not written (each also raised as a SinkError to the caller)
        self.lost_records = 0
        self._clock: Callable[[], float] = time.monotonic
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._size = 0
        self._guard = False  # the file may end in a torn fragment: start the next line with "\n"
        self._retry_at = 0.0
        self._delay = 0.0
        self._rotate_at = 0.0
        self._logged: set[str] = set()
        self._lost_steps: list[int] = []  # first and last step lost in the current outage
        self._lost_now = 0
        self._closed = False
        self._open()

    # ----------------------------------------------------------------------------------
    def write(self, record: StepRecord) -> None:
        """Append ``record`` as one line, rotating first if the file would exceed ``max_bytes``.

        Raises:
            SinkError: the record was lost (I/O failure, or waiting to retry); already logged.
            ValueError: the sink is closed. TypeError: a record field holds a non-JSON value.
        """
        line = encode_record(record)
        with self._lock:
            if self._closed:
                raise ValueError("JsonlSink is closed")
            now = self._clock()
            if self._fd is not None and self._vanished():
                self._note("vanished", f"{self.path} was deleted or replaced; re-opening it")
                self._drop_fd()
            if self._fd is None:
                if now < self._retry_at:
                    self._lose(record.step, f"waiting {self._retry_at - now:.1f} s to retry")
                try:
                    self._open()
                except OSError as e:
                    self._fail("open", e, now)
                    self._lose(record.step, f"cannot open {self.path}: {e}")
            if self.max_bytes and self._size > 0 and self._size + len(line) > self.max_bytes \
                    and now >= self._rotate_at:
                try:
                    self._rotate()
                except OSError as e:  # go on appending to path (re-opened), retry rotating later
                    self._rotate_at = now + self.retry_max_s
                    self._note("rotate", f"rotating {self.path} failed ({_errname(e)}: {e}); appending to "
                                         f"it past max_bytes, next rotation attempt in {self.retry_max_s:.0f} s")
                    self._drop_fd()
                    try:
                        self._open()
                    except OSError as e2:
                        self._fail("open", e2, now)
                        self._lose(record.step, f"cannot open {self.path}: {e2}")
            try:
                self._append(b"\n" + line if self._guard else line)
            except OSError as e:
                self._fail("write", e, now)
                self._lose(record.step, f"cannot write {self.path}: {e}")
            self._guard = False
            self._recovered()

    # ----------------------------------------------------------------------------------
    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _drop_torn_tail(self.path)
        except OSError:
            self._guard = True  # cannot cut it: end it instead
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        st = os.fstat(fd)
        self._fd, self._ident, self._size = fd, (st.st_dev, st.st_ino), st.st_size

    def _drop_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None

    def _vanished(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._ident

    def _append(self, line: bytes) -> None:
        """One ``os.write`` (looped only on a short write); on failure cut the partial line off."""
        assert self._fd is not None
        view, done = memoryview(line), 0
        try:
            while done < len(line):
                n = os.write(self._fd, view[done:])
                if n <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                done += n
            if self.fsync:
                os.fsync(self._fd)
        except OSError:
            if 0 < done < len(line):
                try:
                    os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - done)
                except OSError:
                    self._guard = True
            raise
        self._size += len(line)

    def _rotate(self) -> None:
        self._drop_fd()
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
        else:
            self.path.unlink(missing_ok=True)
        self._open()
        if self.fsync:
            _fsync_dir(self.path.parent)

    def _fail(self, kind: str, e: OSError, now: float) -> None:
        self._drop_fd()
        self._delay = min(max(self._delay * 2, self.retry_min_s), self.retry_max_s)
        self._retry_at = now + self._delay
        self._note(f"{kind}:{_errname(e)}",
                   f"{kind} of {self.path} failed ({_errname(e)}: {e}); records are lost (counted in "
                   f"distgrad_sink_errors_total{{sink=\"jsonl\"}}) until it works again, retrying with back-off")

    def _lose(self, step: int, why: str) -> None:
        self.lost_records += 1
        self._lost_now += 1
        self._lost_steps = [self._lost_steps[0] if self._lost_steps else step, step]
        raise SinkError(f"jsonl: record of step {step} lost: {why}")

    def _note(self, kind: str, msg: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("distgrad: jsonl sink: %s", msg)

    def _recovered(self) -> None:
        self._delay, self._retry_at = 0.0, 0.0
        if self._lost_now:
            log.warning("distgrad: jsonl sink: writing %s again; %d record(s) lost (steps %d..%d)", self.path,
                        self._lost_now, self._lost_steps[0], self._lost_steps[1])
            self._lost_now, self._lost_steps = 0, []
            self._logged.clear()

    def flush(self) -> None:
        """Force the file to stable storage (``os.fsync``), whatever the ``fsync`` option."""
        with self._lock:
            if not self._closed and self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        """Flush (``fsync`` with that option) and close the file; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.fsync and self._fd is not None:
                    os.fsync(self._fd)
            finally:
                self._drop_fd()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, type(e).__name__)


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
               on_bad_line: Callable[[str], None] | None = None) -> Iterator[StepRecord]:
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
            line number), or a schema other than :data:`SCHEMA_VERSION`.
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
