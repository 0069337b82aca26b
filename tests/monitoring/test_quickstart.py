"""The README's paging quickstart, followed as written: ``launch/monitoring_stack.sh`` (real
Prometheus and Alertmanager with the shipped rules and routing, and the built-in echo receiver)
and ``launch/run_example.sh --inject nan --inject-step 20`` (the default example job, 2 CPU
ranks; only its ports differ). The page the echo receiver prints names the origin step, the
culprit rank and the culprit module, and equals the one quoted in the README (up to the time,
the ports, the clone's path and the step the run had reached). About 1-3 minutes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .stack import REPO, MissingBinary, find_binary, free_port

pytestmark = [pytest.mark.monitoring, pytest.mark.multirank]

#: the README quotes the page between these markers
BEGIN, END = "<!-- quickstart page: begin -->", "<!-- quickstart page: end -->"


def alert_block(text: str, alertname: str, status: str = "FIRING") -> str | None:
    """The echo receiver's lines of the first ``alertname`` alert in ``text`` whose status matches
    the regex ``status`` (from its status line to its ``runbook:`` line), or None."""
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if re.match(rf"\s+(?:{status}) \S+ {alertname}\b", ln):
            for j in range(i + 1, len(lines)):
                if lines[j].strip().startswith("runbook:"):
                    return "\n".join(lines[i:j + 1])
    return None


def normalized(block: str) -> str:
    """``block`` on one line, whitespace collapsed (the receiver wraps at 100 columns), with what
    differs between two runs of the quickstart replaced: ports, the clone's path, the step the run
    had reached when the rule was evaluated."""
    s = " ".join(block.split())
    s = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", s)
    s = re.sub(r"file://\S*?/docs/runbook\.md", "file://CLONE/docs/runbook.md", s)
    return re.sub(r"last sampled step: \d+", "last sampled step: N", s)


def _readme_page() -> str:
    text = (REPO / "README.md").read_text()
    quoted = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    return quoted.strip().removeprefix("```text").removesuffix("```").strip()


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait(pred, timeout: float, what: str, logs: list[Path]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


def test_readme_paging_quickstart_pages_with_the_culprit_rank_and_module(tmp_path):
    try:
        find_binary("PROMETHEUS", "prometheus")
        find_binary("ALERTMANAGER", "prometheus-alertmanager", "alertmanager")
    except MissingBinary as e:
        pytest.skip(f"monitoring binaries missing: {e}")
    port = free_port()
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1",
               DISTGRAD_SETUP="0", DISTGRAD_VENV=str(Path(sys.executable).parent.parent), MASTER_PORT=str(free_port()))
    stack_log, run_log = tmp_path / "stack.log", tmp_path / "run.log"
    # terminal 1 of the README (ports moved off the defaults)
    stack = _start(["bash", "launch/monitoring_stack.sh", "--target", f"127.0.0.1:{port}",
                    "--prometheus-port", str(free_port()), "--alertmanager-port", str(free_port()),
                    "--echo-port", str(free_port()), "--targets-dir", str(tmp_path / "targets"),
                    "--data-dir", str(tmp_path / "stack")], stack_log, env)
    run = None
    try:
        _wait(lambda: "distgrad monitoring stack running" in stack_log.read_text() or stack.poll() is not None,
              60, "the monitoring stack", [stack_log])
        assert stack.poll() is None, stack_log.read_text()
        # terminal 2 of the README
        run = _start(["bash", "launch/run_example.sh", "--inject", "nan", "--inject-step", "20", "--port", str(port)],
                     run_log, env)
        block = _wait(lambda: alert_block(stack_log.read_text(), "DistgradNonFiniteGradients"), 420,
                      "the NaN page on the echo receiver", [stack_log, run_log])
    finally:
        if run is not None:
            _stop(run)
        _stop(stack)
    text = stack_log.read_text()
    # the notification's heading (the run's other alerts of the same group may come first)
    head = [ln for ln in text[:text.index(block)].splitlines() if ln.startswith("[")][-1]
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\] PAGE \(receiver distgrad-pager, \d firing"
                        r"(, \d resolved)?\)", head), head
    page = normalized(block)
    # the event: where the streak started, who made it, in which module (distgrad's forward replay)
    assert page.startswith(f"FIRING critical DistgradNonFiniteGradients job distgrad instance 127.0.0.1:PORT "
                           f"NaN/Inf gradients in distgrad from step 20. "), page
    assert "has NaN/Inf gradients since sampled optimizer step 20, where the streak started" in page
    assert "non-finite before the reduction: 1. " in page
    assert "first went NaN/Inf when that step was replayed: blocks.2.mlp.fc (rank 1). " in page
    assert page.endswith("runbook: file://CLONE/docs/runbook.md#distgradnonfinitegradients"), page
    # the README shows what a person receives: this page
    quoted = _readme_page()
    assert normalized(alert_block(quoted, "DistgradNonFiniteGradients") or "") == page, (quoted, block)
    # DistgradNaNLoss comes in the same notification when a scrape saw the NaN loss (timing): its
    # text then equals the README's too (firing or already resolved)
    got, shown = (alert_block(t, "DistgradNaNLoss", "FIRING|RESOLVED") for t in (text, quoted))
    if got is not None and shown is not None:
        assert normalized(got.split(None, 1)[1]) == normalized(shown.split(None, 1)[1]), (got, shown)
