#!/usr/bin/env python3
"""A tiny Alertmanager webhook receiver that prints each notification as a person would read it.

``launch/monitoring_stack.sh`` starts it on 127.0.0.1 when no ``--pager-url`` / ``--ticket-url``
is given (``--echo``), and the shipped ``configs/alertmanager.yml`` posts critical alerts to
``/pager`` and warnings to ``/ticket`` of it. Standalone::

    python launch/echo_receiver.py --port 9095

One block per notification (Alertmanager webhook format, version 4), e.g.::

    [2026-12-02 01:40:12 UTC] PAGE (receiver distgrad-pager, 1 firing)
      FIRING critical DistgradNonFiniteGradients  run llama-7b  job distgrad  instance 127.0.0.1:9400
        NaN/Inf gradients in distgrad.
        <description>
        runbook: docs/runbook.md#distgradnonfinitegradients

The tests (``tests/monitoring/``) use :class:`EchoReceiver` in-process to read what a person on
call would be sent. Standard library only; not part of the distgrad library.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO

#: Path of the request -> the kind of notification printed (configs/alertmanager.yml's URLs).
KINDS = {"/pager": "PAGE", "/ticket": "TICKET"}


def format_notification(payload: dict[str, Any], path: str = "/", now: float | None = None) -> str:
    """The text of one Alertmanager webhook notification (``payload``, version 4) received on
    ``path``: a heading (time in UTC, PAGE / TICKET / NOTIFICATION after ``path``, the receiver,
    how many alerts fire / resolved), then per alert its status, severity, alert name, run, job,
    instance, summary, description and runbook URL. Missing fields print as ``-``."""
    kind = KINDS.get(path.rstrip("/") or "/", "NOTIFICATION")
    alerts = payload.get("alerts", [])
    n_firing = sum(1 for a in alerts if a.get("status") == "firing")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(time.time() if now is None else now))
    counts = ", ".join(x for x in (f"{n_firing} firing" if n_firing else "",
                                   f"{len(alerts) - n_firing} resolved" if len(alerts) > n_firing else "") if x)
    lines = [f"[{stamp}] {kind} (receiver {payload.get('receiver', '-')}, {counts or 'no alerts'})"]
    for a in alerts:
        lab, ann = a.get("labels", {}), a.get("annotations", {})
        who = "  ".join(f"{k} {lab[k]}" for k in ("run", "job", "instance") if lab.get(k))
        lines.append(f"  {str(a.get('status', '-')).upper()} {lab.get('severity', '-')} "
                     f"{lab.get('alertname', '-')}  {who}".rstrip())
        for key in ("summary", "description"):
            if ann.get(key):
                lines.extend(textwrap.wrap(ann[key], 100, initial_indent="    ", subsequent_indent="    ",
                                           break_long_words=False, break_on_hyphens=False))
        lines.append(f"    runbook: {ann.get('runbook_url', '-')}")
    return "\n".join(lines) + "\n"


class EchoReceiver:
    """The receiver as an in-process server (a thread): prints each notification to ``out``
    (None: print nothing) and keeps them for :meth:`notifications` / :meth:`alerts`.

    Args:
        host: address to bind; loopback by default (notifications carry run details).
        port: TCP port; 0 picks a free one (see :attr:`url`).
        out: text stream to print to (default ``sys.stdout``), or None.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, out: TextIO | None = sys.stdout) -> None:
        self._lock = threading.Lock()
        self._got: list[tuple[str, dict[str, Any]]] = []
        self.out = out
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"invalid_json": body.decode(errors="replace")}
                receiver._received(self.path.split("?")[0], payload)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802  readiness probe
                body = b"distgrad echo receiver: POST Alertmanager webhooks to /pager or /ticket\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="echo-receiver", daemon=True)
        self._thread.start()

    def _received(self, path: str, payload: dict[str, Any]) -> None:
        with self._lock:
            self._got.append((path, payload))
            if self.out is not None:
                self.out.write(format_notification(payload, path) if "alerts" in payload
                               else f"unreadable notification on {path}: {payload}\n")
                self.out.flush()

    @property
    def url(self) -> str:
        """``http://host:port/`` of the receiver; add ``pager`` / ``ticket`` for the routes."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def notifications(self, path: str | None = None) -> list[dict[str, Any]]:
        """Every notification received so far (on ``path``, e.g. ``"/pager"``, if given)."""
        with self._lock:
            return [p for q, p in self._got if path is None or q == path]

    def alerts(self, alertname: str | None = None, status: str | None = None,
               path: str | None = None) -> list[dict[str, Any]]:
        """The alerts of the notifications received (on ``path``), optionally only those named
        ``alertname`` and with ``status`` "firing" or "resolved"."""
        return [a for p in self.notifications(path) for a in p.get("alerts", [])
                if (alertname is None or a["labels"].get("alertname") == alertname)
                and (status is None or a.get("status") == status)]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "EchoReceiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=9095, help="port (default 9095; 0: any free port)")
    args = ap.parse_args(argv)
    try:
        receiver = EchoReceiver(args.host, args.port)
    except OSError as e:
        print(f"echo receiver: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    print(f"echo receiver listening on {receiver.url} (pager: {receiver.url}pager, ticket: {receiver.url}ticket)",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
