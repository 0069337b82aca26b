"""distgrad report / summary: plots, HTML, verdict, downsampling and bounded memory."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from distgrad.cli import main
from distgrad.record import ParamStats, Provenance, Spikes, StepRecord, UnsampledNonfinite
from distgrad.report import (Downsampler, RollingMadSpikes, analyze, layer_of,
                             layer_sort_key)
from distgrad.export.jsonl import JsonlSink, encode_record

ROOT = Path(__file__).resolve().parent.parent
needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                               reason="matplotlib not installed (distgrad[report] extra)")

NAN_STEP = 137
NAN_PARAM = "model.layers.2.mlp.up_proj.weight"
SPIKE_STEP = 300
OVERFLOW_STEPS = {40, 41, 250}
N_LAYERS = 6


def param_names(n_layers: int = N_LAYERS) -> list[str]:
    out = ["model.embed_tokens.weight"]
    for i in range(n_layers):
        out += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.o_proj.weight",
                f"model.layers.{i}.mlp.up_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"]
    return out + ["model.norm.weight", "lm_head.weight"]


def make_record(step: int, names: list[str], rng: np.random.Generator, *, nan_param: str | None = None,
                overflow: bool = False, spike: float = 1.0, nonfinite_ranks: list[int] | None = None,
                **parts) -> StepRecord:
    P = len(names)
    numel = np.full(P, 4096.0)
    sumsq = numel * rng.uniform(0.5, 1.5, P) * 1e-4 * spike ** 2
    nan = np.zeros(P)
    inf = np.zeros(P)
    if nan_param is not None:
        j = names.index(nan_param)
        nan[j] = 4
        sumsq[j] = np.nan
    if overflow:  # fp16 overflow: Inf everywhere in one parameter, step skipped by the scaler
        inf[-1] = 10
        sumsq[-1] = np.inf
    ps = ParamStats(names=list(names), numel=numel, sum=rng.standard_normal(P) * 1e-3, sumsq=sumsq, nan=nan,
                    inf=inf, zeros=np.zeros(P), min=-np.ones(P), max=np.ones(P))
    return StepRecord(step=step, micro_step=step * 4, timestamp=1.7e9 + step, world_size=4, params=ps,
                      grad_norm=float(np.sqrt(sumsq.sum())), loss=float(3.0 - 1e-3 * step + 0.01 * rng.standard_normal()),
                      loss_scale=2.0 ** 14 if step > 41 else 2.0 ** 16, overflow=overflow, step_applied=not overflow,
                      counters={"sampled_steps": step + 1}, nonfinite_ranks=list(nonfinite_ranks or []),
                      **parts)


def write_run(path: Path, n: int = 400, nan_step: int | None = NAN_STEP, with_ratios: bool = True) -> list[str]:
    rng = np.random.default_rng(42)
    names = param_names()
    with JsonlSink(path) as sink:
        for t in range(n):
            parts = {}
            if with_ratios:
                parts["update_ratio"] = {nm: float(rng.uniform(1e-4, 1e-2)) for nm in names[::3]}
            sink.write(make_record(
                t, names, rng, nan_param=NAN_PARAM if t == nan_step else None, overflow=t in OVERFLOW_STEPS,
                spike=30.0 if t == SPIKE_STEP else 1.0, nonfinite_ranks=[2] if t == nan_step else None, **parts))
    return names


@pytest.fixture(scope="module")
def run_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "run.jsonl"
    write_run(path)
    return path


@needs_mpl
def test_report_writes_plots_and_verdict(run_log, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", str(run_log), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"step {NAN_STEP}" in printed and NAN_PARAM in printed
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["layer_grad_norm.png", "layer_nonfinite.png", "loss_grad_norm.png", "loss_scale.png",
                    "update_ratio.png"]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5
    assert "src=\"http" not in page and "<link" not in page  # self-contained
    verdict = page[page.index('id="verdict"'):]
    verdict = verdict[:verdict.index("</p>")]
    assert verdict.index("PROBLEM") < verdict.index(f"step {NAN_STEP}")
    assert NAN_PARAM in verdict and "rank(s) [2]" in verdict
    assert (out / "summary.txt").read_text().startswith("distgrad summary")


def test_analysis_details(run_log):
    a = analyze(run_log)
    assert a.n_records == 400 and (a.first_step, a.last_step) == (0, 399)
    p = a.first_problem
    assert (p.kind, p.step, p.param, p.ranks) == ("nonfinite_grad", NAN_STEP, NAN_PARAM, [2])
    assert p.layer == layer_of(NAN_PARAM)
    # handled fp16 overflows are counted, not problems; the 30x grad-norm spike of step 300 is one
    assert [(q.kind, q.step) for q in a.problems] == [("nonfinite_grad", NAN_STEP), ("grad_norm_spike", SPIKE_STEP)]
    c = a.counts
    assert c["nonfinite_steps"] == 1 + len(OVERFLOW_STEPS)
    assert c["nonfinite_grad"] == 1 and c["overflow_steps"] == len(OVERFLOW_STEPS)
    assert c["skipped_steps"] == len(OVERFLOW_STEPS)
    assert a.first_step_of["overflow_steps"] == 40
    assert a.max_overflow_streak == 2
    # rolling median/MAD rule finds the injected grad-norm spike
    assert a.spikes_source == "rolling-mad"
    assert (SPIKE_STEP, "grad_norm") in [(s, m) for s, m, _ in a.spikes]
    assert c["grad_norm_spikes"] <= 3
    # per-layer aggregates
    j = a.layers.index(layer_of(NAN_PARAM))
    assert a.layer_nonfinite_elems[j] == 4 and a.layer_nonfinite_steps[j] == 1
    assert a.layers == sorted(a.layers, key=layer_sort_key)
    assert a.update_ratio is not None
    # the spike survives in the layer heatmap data (bucket max) and in the scalar envelope
    assert np.nanmax(a.scalars.max[:, 1]) > 10 * np.nanmedian(a.scalars.last[:, 1])


def test_provenance_and_detector_spikes_from_records(tmp_path):
    """The typed records' provenance and the detectors' spikes give the problem and the spikes."""
    path = tmp_path / "run.jsonl"
    names = param_names(3)
    rng = np.random.default_rng(0)
    prov = {"step": 30, "params": [{"name": names[1], "nan": 1, "inf": 0, "ranks": [0]},
                                   {"name": names[5], "nan": 7, "inf": 0, "ranks": [3, 1]}], "first_param": names[5]}
    with JsonlSink(path) as sink:
        for t in range(50):
            r = make_record(t, names, rng, spikes=Spikes(flagged=["loss"] if t == 20 else []))
            if t == 30:
                for n, k in ((names[1], 1), (names[5], 7)):
                    j = names.index(n)
                    r.params.nan[j] = k
                    r.params.sumsq[j] = np.nan
                r.grad_norm = math.nan
                r.provenance = Provenance.from_dict(prov)
            sink.write(r)
    a = analyze(path)
    p = a.first_problem
    assert (p.step, p.param, p.ranks) == (30, names[5], [1, 3])
    assert a.spikes_source == "record"
    assert a.counts["loss_spikes"] == 1 and a.counts["grad_norm_spikes"] == 0
    assert [(s, m) for s, m, _ in a.spikes] == [(20, "loss")]


@needs_mpl
def test_healthy_run_and_exit_codes(tmp_path, capsys):
    path = tmp_path / "ok.jsonl"
    write_run(path, n=120, nan_step=None, with_ratios=False)
    a = analyze(path)
    assert a.healthy and a.verdict().startswith("HEALTHY")
    assert main(["summary", str(path), "--fail-on-problem"]) == 0
    out = tmp_path / "rep"
    assert main(["report", str(path), "-o", str(out), "--fail-on-problem"]) == 0
    assert not (out / "update_ratio.png").exists()
    assert "HEALTHY" in (out / "report.html").read_text()
    bad = tmp_path / "bad.jsonl"
    write_run(bad, n=150)
    assert main(["summary", str(bad), "--fail-on-problem"]) == 3
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "missing.jsonl")]) == 1
    assert "error" in capsys.readouterr().err
    assert main(["bogus"]) == 2
    assert main(["report", str(path), "-o", str(out), "--max-points", "3"]) == 2


def test_summary_table(run_log, capsys):
    assert main(["summary", str(run_log), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "last step: 399" in text
    assert f"PROBLEM at step {NAN_STEP}" in text and NAN_PARAM in text
    lines = text.splitlines()
    row = next(ln for ln in lines if ln.startswith("non-finite gradient steps"))
    assert row.split()[-2:] == [str(1 + len(OVERFLOW_STEPS)), "40"]
    row = next(ln for ln in lines if ln.startswith("fp16 overflow steps"))
    assert row.split()[-2:] == [str(len(OVERFLOW_STEPS)), "40"]
    # worst layers: the non-finite layer first, then 2 more
    i = next(k for k, ln in enumerate(lines) if ln.startswith("worst layers"))
    table = [ln.split() for ln in lines[i + 3:i + 6]]
    assert len(table) == 3
    # layers with non-finite gradients first (the fp16 overflows put Inf into lm_head on 3 steps)
    assert [row[0] for row in table[:2]] == [layer_of("lm_head.weight"), layer_of(NAN_PARAM)]
    assert [row[-1] for row in table] == [str(len(OVERFLOW_STEPS)), "1", "0"]


def test_downsampler_keeps_extremes():
    rng = np.random.default_rng(3)
    n = 10_001
    v = rng.uniform(1, 2, (n, 2))
    v[7777, 0] = 1000.0
    v[123, 1] = np.nan
    ds = Downsampler(2, 1, max_buckets=64)
    for t in range(n):
        ds.add(t, v[t], np.array([1.0]))
    r = ds.result()
    assert len(r.step_first) <= 65 and r.width == 256
    assert r.records.sum() == n and r.counts[:, 0].sum() == n
    assert r.step_first[0] == 0 and r.step_last[-1] == n - 1
    assert np.all(r.step_first[1:] == r.step_last[:-1] + 1)
    # exact min/max/last per bucket vs brute force
    for b in range(len(r.step_first)):
        seg = v[r.step_first[b]:r.step_last[b] + 1]
        assert np.array_equal(r.max[b], np.nanmax(seg, axis=0))
        assert np.array_equal(r.min[b], np.nanmin(seg, axis=0))
        assert np.array_equal(r.last[b], seg[-1], equal_nan=True)
    assert np.nanmax(r.max[:, 0]) == 1000.0


def test_rolling_mad_rule():
    rng = np.random.default_rng(0)
    det = RollingMadSpikes()
    x = 1.0 + 0.05 * rng.standard_normal(500)
    x[250] = 5.0
    x[260] = math.nan
    flagged = [i for i, v in enumerate(x) if det.update(float(v))]
    assert flagged == [250]


def test_layer_fallback_without_naming():
    def broken(name):
        raise RuntimeError("naming not ready")

    assert layer_of("model.layers.12.mlp.w", classify=broken) == "12"
    assert layer_of("transformer/h/3/attn", classify=broken) == "3"
    assert layer_of("lm_head.weight", classify=broken) == "other"


def test_overflow_streak_names_a_problem(tmp_path):
    path = tmp_path / "ovf.jsonl"
    rng = np.random.default_rng(1)
    names = param_names(2)
    with JsonlSink(path) as sink:
        for t in range(60):
            sink.write(make_record(t, names, rng, overflow=10 <= t < 35))
    a = analyze(path, overflow_streak_limit=20)
    assert a.max_overflow_streak == 25
    p = a.first_problem
    assert (p.kind, p.step) == ("overflow_streak", 29) and "steps 10..29" in p.detail


@needs_mpl
def test_empty_log(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert main(["summary", str(path)]) == 0
    assert "EMPTY" in capsys.readouterr().out
    assert main(["report", str(path), "-o", str(tmp_path / "r"), "--fail-on-problem"]) == 3
    assert (tmp_path / "r" / "report.html").exists()


def test_layer_order():
    assert sorted(["head", "10", "2", "embed", "other", "norm", "dec.1", "enc.3", "enc.0"], key=layer_sort_key) == [
        "embed", "enc.0", "enc.3", "2", "10", "dec.1", "norm", "head", "other"]


# ----------------------------------------------------------------------------------------------
# bounded memory
# ----------------------------------------------------------------------------------------------


def write_synthetic(path: Path, n_steps: int, n_params: int, nan_step: int) -> None:
    """Fast writer of a large run: 64 pre-encoded parameter blocks (real JsonlSink encoding,
    short floats) cycled, one NaN block at ``nan_step``; ~3 KB per line at 50 params."""
    rng = np.random.default_rng(9)
    names = [f"h.{i // 5}.w{i % 5}" for i in range(n_params)]

    def block(nan_at: int | None = None) -> str:
        P = n_params
        sumsq = np.round(rng.uniform(0.1, 2.0, P), 3)
        nan = np.zeros(P)
        if nan_at is not None:
            sumsq[nan_at] = np.nan
            nan[nan_at] = 1
        ps = ParamStats(names=names, numel=np.full(P, 4096.0), sum=np.round(rng.standard_normal(P), 2),
                        sumsq=sumsq, nan=nan, inf=np.zeros(P), zeros=np.zeros(P),
                        min=np.round(-rng.uniform(0, 1, P), 2), max=np.round(rng.uniform(0, 1, P), 2))
        rec = StepRecord(step=0, micro_step=0, timestamp=0.0, world_size=8, params=ps, grad_norm=1.0)
        return json.dumps(json.loads(encode_record(rec))["params"], separators=(",", ":"))

    blocks = [block() for _ in range(64)]
    bad = block(nan_at=17)
    with open(path, "w") as f:
        for s in range(n_steps):
            nanstep = s == nan_step
            f.write(f'{{"schema":2,"step":{s},"micro_step":{4 * s},"timestamp":{1.7e9 + s},"world_size":8,'
                    f'"grad_norm":{"NaN" if nanstep else 1.0 + (s * 7919 % 13) / 10},"loss":{3.0 - s * 1e-5},'
                    f'"loss_scale":null,"overflow":null,"step_applied":true,"counters":{{"sampled_steps":{s + 1}}},'
                    f'"replica_mismatch_ranks":[],"nonfinite_ranks":{[5] if nanstep else []},'
                    f'"params":{bad if nanstep else blocks[s % 64]}}}\n')


def test_analysis_memory_does_not_grow_with_steps(tmp_path):
    """tracemalloc peak of the streaming analysis: bounded, and the same for 4x more steps."""
    paths = {}
    for n in (1000, 4000):
        paths[n] = tmp_path / f"run{n}.jsonl"
        write_synthetic(paths[n], n, 50, nan_step=n - 10)
    analyze(paths[1000], max_points=256)  # warm-up: one-time imports and name caches
    peaks = {}
    for n, path in paths.items():
        tracemalloc.start()
        try:
            a = analyze(path, max_points=256)
            peaks[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert a.n_records == n and a.first_problem.step == n - 10
        assert a.first_problem.param == "h.3.w2" and a.first_problem.ranks == [5]
    file_size = paths[4000].stat().st_size
    assert peaks[4000] < 2 * 1024 * 1024 < file_size
    assert peaks[4000] < 1.25 * peaks[1000] + 128 * 1024, peaks


@needs_mpl
def test_report_100k_steps_bounded_rss(tmp_path):
    """100k steps x 50 parameters (~330 MB of JSONL) through the real CLI in a child process:
    the peak RSS grows by far less than the file size over the post-import baseline."""
    n = 100_000
    path = tmp_path / "big.jsonl"
    write_synthetic(path, n, 50, nan_step=77_777)
    size = path.stat().st_size
    out = tmp_path / "rep"
    code = (
        "import resource, sys, json\n"
        "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot\n"
        "import distgrad.report, distgrad.cli\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "rc = distgrad.cli.main(sys.argv[1:])\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'rc': rc, 'base_kb': base, 'peak_kb': peak}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, "report", str(path), "-o", str(out)], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0
    growth = (res["peak_kb"] - res["base_kb"]) * 1024
    assert size > 250e6
    assert growth < 100e6, (growth, size)
    assert "PROBLEM at step 77777" in p.stdout and "h.3.w2" in p.stdout
    assert (out / "report.html").exists() and (out / "layer_grad_norm.png").exists()


def test_summary_skips_a_corrupt_middle_line_and_flags_appended_runs(tmp_path):
    """A damaged line in the middle is skipped and reported (not fatal); a second run appended to
    the same file (steps going back) is pointed out."""
    from distgrad.report import analyze, format_summary
    from distgrad.export.jsonl import JsonlSink

    names = ["layers.0.w", "layers.1.w"]
    rng = np.random.default_rng(0)
    path = tmp_path / "run.jsonl"
    with JsonlSink(path) as sink:
        for step in (0, 1, 2, 0, 1):  # a restart after step 2
            sink.write(make_record(step, names, rng))
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = '{"schema": 1, "step": 1, "bro\n'
    path.write_text("".join(lines))
    a = analyze(path)
    assert a.n_records == 4 and a.bad_lines == 1 and a.first_bad_line.startswith(f"{path}:2:")
    assert a.restarts == 1
    text = format_summary(a)
    assert "skipped 1 malformed line(s)" in text and "went back 1 time(s)" in text


def test_verdict_names_records_lost_by_the_sink_and_torn_lines(tmp_path, monkeypatch, capsys):
    """Disk full for steps 5..24 (a short write tears step 5's line, and it cannot be cut off),
    then freed: the summary is not HEALTHY and names the gap and the torn line."""
    import errno

    from distgrad.export import jsonl as jsonl_mod
    from distgrad.export.base import SinkError

    names = ["layers.0.w", "layers.1.w"]
    rng = np.random.default_rng(0)
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path, retry_min_s=0.0)
    real_write = os.write
    state = {"full": False, "room": 0}

    def write(fd, data):
        if fd == sink._fd and state["full"]:
            if state["room"]:
                n, state["room"] = state["room"], 0
                return real_write(fd, bytes(data[:n]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def fail(*a):
        raise OSError(errno.EIO, "cannot cut")

    monkeypatch.setattr(jsonl_mod.os, "write", write)
    monkeypatch.setattr(jsonl_mod.os, "ftruncate", fail)
    monkeypatch.setattr(jsonl_mod, "_drop_torn_tail", fail)
    lost = []
    for step in range(40):
        state.update(full=5 <= step < 25, room=100 if step == 5 else 0)
        try:
            sink.write(make_record(step, names, rng))
        except SinkError:
            lost.append(step)
    sink.close()
    assert lost == list(range(5, 25))
    a = analyze(path)
    assert not a.healthy and a.n_records == 20 and a.bad_lines == 1
    v = a.verdict()
    assert v.startswith("PROBLEM at step 5: 20 sampled-step record(s) missing from the log: 20 between steps 4 and 25")
    assert "malformed_lines at step 5" in v
    assert a.counts["missing_records"] == 20
    assert main(["summary", str(path), "--fail-on-problem"]) == 3
    assert "20 between steps 4 and 25" in capsys.readouterr().out


def test_verdict_names_nonfinite_unsampled_steps(tmp_path):
    names = ["layers.0.w", "layers.1.w"]
    rng = np.random.default_rng(0)
    path = tmp_path / "run.jsonl"
    with JsonlSink(path) as sink:
        for i, step in enumerate(range(0, 40, 4)):  # interval 4
            un = UnsampledNonfinite(grad=[13, 14, 15], loss=[15]) if step == 16 else None
            r = make_record(step, names, rng, unsampled_nonfinite=un)
            r.counters["sampled_steps"] = i + 1
            sink.write(r)
    a = analyze(path)
    assert a.counts["nonfinite_unsampled"] == 3 and a.counts["nonfinite_loss"] == 1
    assert "missing_records" not in a.counts or a.counts["missing_records"] == 0  # interval 4 is no gap
    assert a.verdict().startswith("PROBLEM at step 13: non-finite gradient on unsampled step(s) 13..15, "
                                  "reported by sampled step 16")
    assert "nonfinite_loss at step 15" in a.verdict()
