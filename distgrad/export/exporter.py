"""The training-process side of rank 0's exporter: snapshot the served families once per change,
hand them to the HTTP helper process (:mod:`distgrad.export.http_server`) when it asks.

Per *change* of the served state (a sampled step's record, counters, the step time) the
collector bumps a version, which :class:`ExporterProcess` publishes in a 16-byte shared memory
map (a ``struct.pack_into``, no system call). Per *scrape* the training process does nothing:
the helper answers from its copy, and only when the version moved does it ask (one line on a
pipe) for the new families, which a daemon thread here snapshots and pickles
(:class:`PageCache`: each part, *head* = run info and counters and *body* = the record's
families, at most once per version) and sends back; the helper renders them with
``prometheus_client``'s exposition. So the training process works at most once per change and
only while someone scrapes, and at most once per ``refresh_s`` (1 s) however many scrape: a
flood of scrapers costs it nothing more.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import prometheus_client

from distgrad.export import http_server
from distgrad.export.http_server import REQUEST, SERVED, SHM_SIZE, VERSIONS, Exposition

log = logging.getLogger("distgrad")

Part = tuple[Callable[[], int], Callable[[], tuple[int, list]]]


class PageCache:
    """Pickled families of the latest state, snapshotted again only when a part's version moves.

    Args:
        parts: ``{name: (version, snapshot)}`` in page order: ``version()`` a cheap int that
            changes with the part's state, ``snapshot()`` returning ``(version, families)``
            consistently (under the collector's lock); families are ``prometheus_client``
            ``Metric`` objects.

    Attributes:
        renders: number of part snapshots (families collected and pickled for the helper) so
            far: the training process's work, once per change, not per scrape (tests).
    """

    def __init__(self, parts: dict[str, Part]) -> None:
        self._parts = parts
        self._cache: dict[str, tuple[int, bytes]] = {}
        self._lock = threading.Lock()
        self.renders = 0

    def versions(self) -> tuple[int, ...]:
        """Current version of every part."""
        return tuple(v() for v, _ in self._parts.values())

    def parts(self) -> tuple[tuple[int, ...], list[bytes]]:
        """``(versions, pickled family lists)`` of the whole page, in page order, every part of
        one state (a part that changed while another was snapshotted is taken again, up to 3
        times)."""
        with self._lock:
            for _ in range(3):
                got = []
                for name, (version, snapshot) in self._parts.items():
                    hit = self._cache.get(name)
                    if hit is None or hit[0] != version():
                        v, fams = snapshot()
                        hit = self._cache[name] = (v, pickle.dumps(list(fams), protocol=pickle.HIGHEST_PROTOCOL))
                        self.renders += 1
                    got.append(hit)
                key = tuple(v for v, _ in got)
                if key == self.versions():
                    break
            return key, [p for _, p in got]

    def page(self, accept: str = "", accept_encoding: str = "", names: Sequence[str] | None = None) -> bytes:
        """The body the helper serves for these request headers and ``name[]`` values, rendered
        here (in-process use and tests)."""
        _, parts = self.parts()
        return Exposition([f for p in parts for f in pickle.loads(p)]).respond(accept, accept_encoding, names)[1]


class ExporterProcess:
    """Start the HTTP helper process for ``cache`` and answer its page requests.

    Args:
        host, port: address to bind (port 0: any free port; the bound one is ``self.port``).
        cache: the pages to serve; its part versions must reach the helper through
            :meth:`notify`, called after every change (the collector's listener).
        timeout_s: connection timeout of the helper (seconds).
        max_connections: connections the helper keeps open at most.
        refresh_s: the helper asks for new families at most this often (seconds; 0: on
            every change).

    Raises:
        OSError: the helper could not bind ``host:port`` (its message) or did not start.
    """

    def __init__(self, host: str, port: int, cache: PageCache, timeout_s: float = 10.0,
                 max_connections: int = 256, refresh_s: float = 1.0) -> None:
        self.cache = cache
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._shm_file = tempfile.TemporaryFile(dir=shm_dir)
        self._shm_file.write(b"\0" * SHM_SIZE)
        self._shm_file.flush()
        self._shm = mmap.mmap(self._shm_file.fileno(), SHM_SIZE)
        self.notify()
        fd = self._shm_file.fileno()
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(http_server.__file__)), host, str(port), str(timeout_s),
             str(max_connections), str(fd), str(refresh_s),
             # the helper runs isolated (-I -S): it is told where prometheus_client lives
             str(Path(prometheus_client.__file__).resolve().parent.parent)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), bufsize=0, close_fds=True,
            # its own session: with the kernel's autogroup scheduling, serving scrapes then does
            # not come out of the training job's CPU share (it exits when our pipe closes)
            start_new_session=True)
        # both pipes were asked for (PIPE), so Popen set both; typed without the Optional
        assert self._proc.stdout is not None and self._proc.stdin is not None
        self._stdout: IO[bytes] = self._proc.stdout
        self._stdin: IO[bytes] = self._proc.stdin
        line = self._stdout.readline().decode().strip()
        if not line.startswith("OK "):
            self._stdin.close()
            self._proc.wait(5)
            self._shm.close()
            self._shm_file.close()
            raise OSError(line[4:] if line.startswith("ERR ") else f"the exporter process did not start ({line!r})")
        self.port = int(line.split()[1])
        self.pid = self._proc.pid
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="distgrad-exporter", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """Publish the current versions to the helper (training thread: a memory write)."""
        v = self.cache.versions()
        try:
            VERSIONS.pack_into(self._shm, 0, v[0], v[-1])
        except ValueError:  # closed: nothing to tell
            pass

    def served(self) -> tuple[int, int, float, float]:
        """What the helper has served (:data:`~distgrad.export.http_server.SERVED`): ``(head
        version of the last page, pages served, time.monotonic() of the last, seconds between
        the last two)``; zeros before the first page."""
        try:
            return SERVED.unpack_from(self._shm, VERSIONS.size)
        except ValueError:  # closed
            return (0, 0, 0.0, 0.0)

    def wait_served(self, head_version: int, max_s: float) -> bool:
        """Wait until a whole page showing head version ``head_version`` or later has been
        served to a Prometheus scrape; True when it has. Waits only for a scraper that has
        come: none when no Prometheus scrape was served (a job nobody scrapes exits at once);
        after one, up to ``max_s`` (its interval is unknown); after two or more, only while it
        keeps coming -- not when the last is older than twice the gap between the last two
        + 1 s -- and until its second next visit is due (last + 2 x gap + 1 s: a page younger
        than the helper's refresh_s may be served once more from its copy; 1 s for jitter on
        a busy host), never longer than ``max_s`` seconds. So a job scraped every 5 s waits at
        most ~11 s, usually until the next scrape."""
        import time

        deadline = time.monotonic() + max(0.0, max_s)
        while True:
            version, n, last, gap = self.served()
            if version >= head_version and n:
                return True
            now = time.monotonic()
            due = last + 2 * gap + 1.0 if n >= 2 and gap > 0 else deadline
            if n == 0 or now > min(deadline, due):
                return False
            time.sleep(0.05 if gap <= 0 else min(0.05, gap / 4))

    def _serve(self) -> None:
        r, w = self._stdout, self._stdin
        while True:
            line = r.readline()
            if not line:
                if not self._closed:
                    log.error("distgrad: the metrics exporter process exited (code %s); /metrics is down",
                              self._proc.poll())
                return
            if line != REQUEST:
                log.error("distgrad: unexpected request from the metrics exporter process: %r", line[:80])
                continue
            try:
                key, parts = self.cache.parts()
                data = pickle.dumps(((key[0], key[-1]), parts), protocol=pickle.HIGHEST_PROTOCOL)
                w.write(struct.pack("<Q", len(data)) + data)
            except (BrokenPipeError, ValueError, OSError):
                return  # closed under us
            except Exception:  # noqa: BLE001  a failing snapshot must not end serving
                log.exception("distgrad: collecting the metrics for the exporter failed")
                data = pickle.dumps(((0, 0), None))  # the helper keeps its copy or answers 503
                try:
                    w.write(struct.pack("<Q", len(data)) + data)
                except OSError:
                    return

    def close(self) -> None:
        """Stop the helper (EOF on its stdin), release the port and the shared map (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._stdout.close()
        self._thread.join(5)
        self._shm.close()
        self._shm_file.close()
