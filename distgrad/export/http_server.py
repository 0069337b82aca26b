"""The HTTP server of rank 0's exporter, run as a separate helper process (standard library plus
``prometheus_client``'s exposition functions).

Why a process: ``prometheus_client.start_http_server`` starts one thread per connection, with no
timeout, and renders the exposition in Python on every scrape, inside the training process.
Any Python work per scrape there competes with the training thread for the GIL (on a busy
machine each hand-over of the GIL also waits for the OS to reschedule the training thread):
a flood of 32 scrapers halved the step rate and 1,000 idle connections made 1,000 threads
(issue 14). Serving from another process leaves the training process one thing to do per
*change* of the served state (snapshot its families, :mod:`distgrad.export.exporter`) and
nothing per scrape.

The helper (``python http_server.py HOST PORT TIMEOUT MAX_CONN SHM_FD REFRESH_S LIBDIR``, started
by :class:`distgrad.export.exporter.ExporterProcess`; ``LIBDIR``: the directory holding
``prometheus_client``, appended to ``sys.path`` since the helper runs with ``-I -S``):

* binds ``HOST:PORT`` and writes ``OK <port>`` (or ``ERR <message>``) on stdout;
* runs one :mod:`selectors` loop (epoll) over non-blocking sockets: no thread per connection,
  at most ``MAX_CONN`` connections (a new one over the cap closes the least recently active
  connection that is not being answered, so idle or half-sent floods cannot lock scrapers
  out); a connection without a whole request, or not taking its response, for ``TIMEOUT``
  seconds since its last progress is closed;
* keeps a copy of the served metric families with the version of the state they show; the
  training process publishes the current version in a shared memory map (``SHM_FD``);
  a scrape that finds its copy out of date asks the training process for the families (one
  line on stdout, a length-prefixed pickle back on stdin), else is answered from the copy; a
  copy younger than ``REFRESH_S`` (default 1 s) is served even when the state has moved on, so
  a flood makes the training process snapshot at most once per second (a scrape sees the state
  of at most ``REFRESH_S`` ago; Prometheus scrapes every 15 s or so);
* answers with ``prometheus_client``'s exposition (:class:`Exposition`): the ``Accept`` header
  chooses the format (``choose_encoder``: text 0.0.4, or OpenMetrics 1.0.0 when asked for),
  Prometheus' ``name[]`` query parameter restricts the page to the samples of those names
  (``restricted_registry``), gzip when ``Accept-Encoding`` allows it; the body of each variant
  is cached per version. distgrad adds one rule: when none of the requested names is served,
  the full page is returned (never an empty 200, which a scraper would read as "target up, no
  data");
* after each whole page served to a Prometheus scrape (a GET with the
  ``X-Prometheus-Scrape-Timeout-Seconds`` header Prometheus sends), writes into the same map
  which state it showed, how many such pages it has served and when (:data:`SERVED`);
* exits when its stdin closes (the training process ended or closed the exporter).

HTTP/1.0 and 1.1 (keep-alive), ``GET`` and ``HEAD``; any path but ``/favicon.ico`` serves the
metrics (as prometheus_client does).
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import select
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

log = logging.getLogger("distgrad")

VERSIONS = struct.Struct("<qq")  # (head, body) versions of the served state, in the shared map
#: written by the helper after each metrics page it serves, at offset VERSIONS.size of the map:
#: (head version of that page, pages served so far, monotonic time of the last one, seconds
#: between the last two), so the training process can wait at close until its final state has
#: been scraped (:meth:`distgrad.export.exporter.ExporterProcess.wait_served`)
SERVED = struct.Struct("<qqdd")
SHM_SIZE = VERSIONS.size + SERVED.size
#: request header every Prometheus scrape carries (lower case): only such pages count as SERVED
SCRAPER_HEADER = "x-prometheus-scrape-timeout-seconds"
_MAX_HEADER = 16 << 10
#: the request line the helper sends for the current families
REQUEST = b"families\n"


class _Families:
    """A collector holding given families (``describe`` too, so that the registry maps every
    sample name to it, which ``restricted_registry`` uses)."""

    def __init__(self, fams: list) -> None:
        self.fams = fams

    def collect(self) -> list:
        return self.fams

    def describe(self) -> list:
        return self.fams


class Exposition:
    """``prometheus_client``'s exposition of a fixed list of metric families, one response body
    cached per variant (format, gzip, requested names).

    Args:
        families: ``prometheus_client`` ``Metric`` objects (one state of the collector).
        max_cached: variants kept at most (the cache is emptied beyond that: ``name[]`` sets
            are chosen by clients).
    """

    def __init__(self, families: Sequence[Any], max_cached: int = 64) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Families(list(families)))
        self._served = frozenset(s.name for f in families for s in f.samples)
        self._cache: dict[tuple, tuple[list[tuple[str, str]], bytes]] = {}
        self._max = max_cached

    def respond(self, accept: str, accept_encoding: str, names: Sequence[str] | None = None
                ) -> tuple[list[tuple[str, str]], bytes]:
        """``(headers, body)`` for a scrape with these ``Accept`` / ``Accept-Encoding`` headers and
        ``name[]`` values: ``prometheus_client.exposition._bake_output`` (``choose_encoder``,
        ``restricted_registry``, gzip), except that names of which none is served give the full
        page. ``headers``: ``Content-Type`` and, when compressed, ``Content-Encoding: gzip``."""
        from prometheus_client import exposition

        _, ctype = exposition.choose_encoder(accept)
        gz = exposition.gzip_accepted(accept_encoding)
        wanted = tuple(sorted(self._served.intersection(names))) if names else ()
        key = (ctype, gz, wanted)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= self._max:
                self._cache.clear()
            params = {"name[]": list(wanted)} if wanted else {}
            _, headers, body = exposition._bake_output(self.registry, accept, accept_encoding, params, False)
            hit = self._cache[key] = (list(headers), body)
        return hit


class Unavailable(Exception):
    """The training process has not provided the families (yet)."""


class RemotePages:
    """The helper's copy of the served families, refreshed from the training process when the
    shared version map says it is out of date (module docstring).

    Args:
        versions: the shared map holding :data:`VERSIONS` of the current state.
        rfd: descriptor of the pipe from the training process (replies).
        wfile: unbuffered binary file of the pipe to it (requests: :data:`REQUEST`).
        wait_s: how long a scrape waits for a refresh before it is answered from the old copy
            (or 503 when there is none).
        refresh_s: a copy younger than this is served even when the state has moved on, so
            that the training process snapshots at most once per ``refresh_s`` however many
            scrapers flood it (0: always the latest state).
    """

    def __init__(self, versions: mmap.mmap, rfd: int, wfile: Any, wait_s: float, refresh_s: float = 0.0) -> None:
        self._versions, self._rfd, self._w, self._wait = versions, rfd, wfile, wait_s
        self._refresh = refresh_s
        self._fetched = 0.0
        self._copy: tuple[tuple[int, int], Exposition] | None = None
        self._pending = False
        self._last_key: tuple[int, int] = (0, 0)
        self._served = 0
        self._served_at = 0.0
        self._gap = 0.0

    def served(self, now: float) -> None:
        """Record in the shared map (:data:`SERVED`) that the page of the last :meth:`page`
        call was served at ``now`` (monotonic seconds)."""
        if self._served:
            self._gap = now - self._served_at
        self._served += 1
        self._served_at = now
        try:
            SERVED.pack_into(self._versions, VERSIONS.size, self._last_key[0], self._served, now, self._gap)
        except (TypeError, ValueError, struct.error):  # a read-only or short map (tests): nothing to tell
            pass

    def receive(self) -> None:
        """Read one reply ``(key, parts)`` (``parts``: pickled family lists, or None when the
        training process failed to snapshot); EOFError when the training process is gone."""
        n = struct.unpack("<Q", _read_exact(self._rfd, 8))[0]
        key, parts = pickle.loads(_read_exact(self._rfd, n))
        self._pending = False
        if parts is not None:  # None: the snapshot failed in the training process (logged there)
            self._copy = (tuple(key), Exposition([f for p in parts for f in pickle.loads(p)]))

    def on_readable(self) -> None:
        """The reply pipe is readable outside a scrape: a late reply, or EOF (raises EOFError)."""
        if not self._pending:
            raise EOFError("the training process closed the exporter")
        self.receive()

    def _fetch(self) -> Exposition:
        current = VERSIONS.unpack_from(self._versions, 0)
        now = time.monotonic()
        if self._copy is not None and (self._copy[0] == current or now - self._fetched < self._refresh):
            self._last_key = self._copy[0]
            return self._copy[1]
        if not self._pending:
            self._w.write(REQUEST)
            self._pending = True
            self._fetched = now
        deadline = time.monotonic() + self._wait
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._rfd], [], [], left)[0]:
                break  # too slow: the copy we have (one state older) or 503
            self.receive()
        if self._copy is None:
            raise Unavailable("the training process has not provided the metrics in time")
        self._last_key = self._copy[0]
        return self._copy[1]

    def page(self, accept: str, accept_encoding: str, names: Sequence[str] | None
             ) -> tuple[list[tuple[str, str]], bytes]:
        """``(headers, body)`` to serve (:meth:`Exposition.respond` of the current copy).

        Raises:
            Unavailable: no copy yet and the training process did not answer within ``wait_s``.
        """
        return self._fetch().respond(accept, accept_encoding, names)


def _read_exact(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            raise EOFError("the training process closed the exporter")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


class _Conn:
    __slots__ = ("sock", "inbuf", "out", "sent", "last", "close_after")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.inbuf = b""
        self.out: memoryview | None = None
        self.sent = 0
        self.last = now
        self.close_after = False


class HttpServer:
    """The selector loop (module docstring), run by :func:`main` in the helper process.

    Args:
        sock: a bound, listening TCP socket (ownership passes to the server).
        pages: has ``page(accept, accept_encoding, names) -> (headers, body)`` (:class:`RemotePages`).
        stop_fd: the pipe from the training process: readable outside a scrape means a late
            reply (``pages.on_readable()``) or EOF, which ends :meth:`run`.
        timeout_s: a connection without a whole request, or with a response not taken, for
            this many seconds since its last progress is closed (default 10 s, Prometheus'
            default scrape timeout).
        max_connections: open connections kept at most (default 256).

    Attributes:
        stats: counters for tests and debugging: ``requests``, ``errors`` (malformed
            requests answered 4xx), ``timeouts``, ``evicted``.
    """

    def __init__(self, sock: socket.socket, pages: Any, stop_fd: int, timeout_s: float = 10.0,
                 max_connections: int = 256) -> None:
        self._lsock = sock
        self._lsock.setblocking(False)
        self.pages = pages
        self.timeout_s, self.max_connections = float(timeout_s), int(max_connections)
        self.stats = {"requests": 0, "errors": 0, "timeouts": 0, "evicted": 0}
        self._conns: dict[int, _Conn] = {}
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, "listen")
        self._sel.register(stop_fd, selectors.EVENT_READ, "stop")

    def run(self) -> None:
        """Serve until the stop descriptor becomes readable (EOF of the training process's pipe)."""
        next_sweep = time.monotonic() + 0.5
        while True:
            try:
                events = self._sel.select(0.5)
                now = time.monotonic()
                for key, mask in events:
                    if key.data == "listen":
                        self._accept(now)
                    elif key.data == "stop":
                        self.pages.on_readable()  # a late reply; EOFError when the trainer is gone
                    else:
                        c = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(c, now)
                        if mask & selectors.EVENT_WRITE and c.out is not None:
                            self._write(c, now)
                if now >= next_sweep:
                    next_sweep = now + 0.5
                    for c in [c for c in self._conns.values() if now - c.last > self.timeout_s]:
                        self.stats["timeouts"] += 1
                        self._drop(c)
            except EOFError:
                return
            except Exception:  # noqa: BLE001  the server must outlive any one bad request
                log.exception("distgrad: metrics exporter error (serving goes on)")
                time.sleep(0.01)

    def _accept(self, now: float) -> None:
        while True:
            try:
                sock, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: shed the oldest idle connection
                log.warning("distgrad: metrics exporter cannot accept: %s", e)
                self._evict_one()
                return
            if len(self._conns) >= self.max_connections and not self._evict_one():
                sock.close()
                continue
            sock.setblocking(False)
            c = _Conn(sock, now)
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _evict_one(self) -> bool:
        idle = [c for c in self._conns.values() if c.out is None]
        if not idle:
            return False
        self.stats["evicted"] += 1
        self._drop(min(idle, key=lambda c: c.last))
        return True

    def _drop(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def _read(self, c: _Conn, now: float) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c)
            return
        c.inbuf += data
        c.last = now
        if c.out is None:
            self._maybe_respond(c, now)

    def _maybe_respond(self, c: _Conn, now: float) -> None:
        end = c.inbuf.find(b"\r\n\r\n")
        if end < 0:
            if len(c.inbuf) > _MAX_HEADER:
                self._respond(c, 431, "Request Header Fields Too Large", b"headers too large\n", close=True)
            return
        head, c.inbuf = c.inbuf[:end].decode("latin-1"), c.inbuf[end + 4:]
        self.stats["requests"] += 1
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._respond(c, 400, "Bad Request", b"malformed request line\n", close=True)
            return
        method, target, version = parts
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        conn_hdr = headers.get("connection", "").lower()
        close = "close" in conn_hdr if version == "HTTP/1.1" else "keep-alive" not in conn_hdr
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            self._respond(c, 400, "Bad Request", b"request bodies are not accepted\n", close=True)
            return
        if method not in ("GET", "HEAD"):
            self._respond(c, 405, "Method Not Allowed", b"GET or HEAD\n", close=close, extra="Allow: GET, HEAD\r\n")
            return
        path, _, query = target.partition("?")
        if path == "/favicon.ico":
            self._respond(c, 404, "Not Found", b"", close=close, head_only=method == "HEAD")
            return
        names = parse_qs(query).get("name[]") if query else None
        try:
            resp, body = self.pages.page(headers.get("accept", ""), headers.get("accept-encoding", ""), names)
        except Unavailable as e:
            self._respond(c, 503, "Service Unavailable", f"{e}\n".encode(), close=close)
            return
        ctype = next(v for k, v in resp if k.lower() == "content-type")
        extra = "".join(f"{k}: {v}\r\n" for k, v in resp if k.lower() != "content-type")
        self._respond(c, 200, "OK", body, close=close, head_only=method == "HEAD", ctype=ctype, extra=extra)
        served = getattr(self.pages, "served", None)
        # a whole page read by Prometheus (or a scraper speaking its protocol: it sends its timeout)
        if served is not None and method == "GET" and not names and SCRAPER_HEADER in headers:
            served(now)

    def _respond(self, c: _Conn, code: int, reason: str, body: bytes, *, close: bool, head_only: bool = False,
                 ctype: str = "text/plain; charset=utf-8", extra: str = "") -> None:
        if code >= 400:
            self.stats["errors"] += 1
        hdr = (f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
               f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n").encode("latin-1")
        c.out, c.sent, c.close_after = memoryview(hdr if head_only else hdr + body), 0, close
        self._write(c, time.monotonic())

    def _write(self, c: _Conn, now: float) -> None:
        out = c.out
        if out is None:  # nothing to send (only called after _respond set it)
            return
        try:
            n = c.sock.send(out[c.sent:])
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._drop(c)
            return
        if n:
            c.sent += n
            c.last = now
        if c.sent < len(out):
            self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
            return
        c.out = None
        if c.close_after:
            self._drop(c)
            return
        self._sel.modify(c.sock, selectors.EVENT_READ, c)
        if c.inbuf:  # a pipelined request already received
            self._maybe_respond(c, now)


def main(argv: list[str]) -> int:
    """Helper process entry: ``HOST PORT TIMEOUT_S MAX_CONNECTIONS SHM_FD REFRESH_S LIBDIR`` (module docstring)."""
    host, port, timeout_s, max_conn, shm_fd = argv[0], int(argv[1]), float(argv[2]), int(argv[3]), int(argv[4])
    # Its lifetime is the training process's (it exits when stdin closes). A launcher that ends a
    # run passes SIGTERM/SIGINT to the whole process tree (deepspeed's terminate_process_tree, a
    # terminal's Ctrl-C): ignored here, so the final "finished" state can still be served.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    refresh_s = float(argv[5])
    if len(argv) > 6 and argv[6] not in sys.path:
        sys.path.append(argv[6])
    logging.basicConfig(format="%(message)s")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    try:
        import prometheus_client.exposition  # noqa: F401  fail now (ERR on stdout), not at the first scrape
    except ImportError as e:
        out.write(f"ERR the exporter process cannot import prometheus_client: {e}\n".encode())
        return 1
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        out.write(f"ERR {e}\n".encode())
        return 1
    versions = mmap.mmap(shm_fd, SHM_SIZE)  # shared, written: SERVED
    out.write(f"OK {sock.getsockname()[1]}\n".encode())
    pages = RemotePages(versions, sys.stdin.fileno(), out, min(3.0, timeout_s / 2), refresh_s)
    HttpServer(sock, pages, sys.stdin.fileno(), timeout_s, max_conn).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
