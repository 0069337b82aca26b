"""``write_report``: the analysis, its plots and one self-contained ``report.html``."""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass
from pathlib import Path

from distgrad.report.analysis import RunAnalysis, analyze
from distgrad.report.plots import render_plots
from distgrad.report.text import format_summary


@dataclass
class ReportResult:
    """Files written by :func:`write_report` and the analysis behind them."""

    out_dir: Path
    html: Path
    pngs: list[Path]
    analysis: RunAnalysis


def write_report(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, max_points: int = 1024,
                 title: str | None = None, include_rotated: bool = True,
                 analysis: RunAnalysis | None = None) -> ReportResult:
    """Analyse a JSONL run log and write PNG plots plus one self-contained ``report.html``.

    Files in ``out_dir`` (created if missing): ``loss_grad_norm.png``, ``layer_grad_norm.png``
    (heatmap, log10), ``layer_nonfinite.png``, and when the run has them ``loss_scale.png``
    (fp16), ``update_ratio.png`` and ``grad_histogram.png`` (``histogram.enabled``); ``report.html`` embeds them as
    base64 and starts with the verdict; ``summary.txt`` holds :func:`format_summary`.

    Args:
        path: run log (see :func:`analyze`).
        out_dir: output directory.
        max_points: downsampling buckets (plot resolution).
        title: page title (default: the log's file name).
        include_rotated: read rotated files too.
        analysis: reuse an existing analysis instead of reading ``path`` again.

    Raises:
        ImportError: matplotlib is missing (``pip install 'distgrad[report]'``).
        FileNotFoundError, ValueError: as :func:`analyze`.
    """
    import matplotlib  # noqa: F401 - a missing matplotlib fails before anything is read or written

    a = analysis if analysis is not None else analyze(path, max_points=max_points, include_rotated=include_rotated)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images, notes = render_plots(a, out)
    s = a.scalars
    bucket_note = (f"Each plotted point covers {s.width} consecutive sampled step(s); line = last value of the "
                   f"bucket, band = min..max within it, so spikes survive downsampling."
                   if a.n_records else "")

    summary = format_summary(a)
    (out / "summary.txt").write_text(summary, encoding="utf-8")
    verdict = a.verdict()
    ok = a.healthy and a.n_records > 0
    title = title or f"distgrad report: {Path(os.fspath(path)).name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1150px;margin:1em auto;padding:0 1em}"
        ".verdict{padding:.8em 1em;border-radius:6px;font-weight:bold}"
        ".ok{background:#e3f6e3;border:1px solid #4a4}.bad{background:#fde4e4;border:1px solid #c33}"
        "pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:12px}img{max-width:100%}"
        "figure{margin:1.5em 0}figcaption{color:#555;font-size:13px}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="verdict {"ok" if ok else "bad"}" id="verdict">{html.escape(verdict)}</p>',
    ]
    if bucket_note:
        parts.append(f"<p>{html.escape(bucket_note)}</p>")
    for n in notes:
        parts.append(f"<p><em>{html.escape(n)}</em></p>")
    sig = getattr(a, "signals", None)
    if sig is not None and sig.findings:
        parts.append('<h2 id="findings">Findings (advice from the gradient signals)</h2><ul>')
        for f in sig.findings:
            parts.append(f'<li id="finding-{html.escape(f.kind)}">step {f.step}: {html.escape(f.detail)}</li>')
        parts.append("</ul>")
    for fname, caption, data in images:
        b64 = base64.b64encode(data).decode("ascii")
        parts.append(f'<figure><img alt="{html.escape(fname)}" src="data:image/png;base64,{b64}">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("<h2>Summary</h2>")
    parts.append(f"<pre>{html.escape(summary)}</pre>")
    parts.append("</body></html>")
    html_path = out / "report.html"
    html_path.write_text("\n".join(parts), encoding="utf-8")
    return ReportResult(out, html_path, [out / f for f, _, _ in images], a)
