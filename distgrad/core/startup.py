"""Set-up of an :class:`~distgrad.core.instrument.Instrument` at ``instrument()`` time: rank 0's sinks
(Prometheus exporter, file_sd target, JSONL / TensorBoard / flight-recorder paths) and the
one all-reduce by which all ranks agree that set-up worked (see :meth:`Instrument.start`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distgrad._version import __version__
from distgrad.core.dist import DTYPE_NAMES, dist_ready
from distgrad.export import metrics

if TYPE_CHECKING:
    from distgrad.core.instrument import Instrument
    from distgrad.export.prometheus import PrometheusSink


def start(inst: Instrument) -> None:
    """:meth:`Instrument.start` (documented there)."""
    err: BaseException | None = None
    ex = inst.config.exporter
    if inst.global_rank == 0 and ex.enabled:
        from distgrad.export.prometheus import PrometheusSink

        static = {"engine": inst.source.engine_name,
                  "zero_stage": "" if inst.source.zero_stage is None else str(inst.source.zero_stage),
                  "dtype": DTYPE_NAMES.get(inst.source.compute_dtype, str(inst.source.compute_dtype)),
                  "version": __version__}
        try:
            sink = PrometheusSink(ex.host, ex.port, static, inst.world_size,
                                  has_loss_scaler=inst.source.has_loss_scaler(),
                                  has_samples=inst.source.samples() is not None,
                                  linger_s=ex.linger_seconds)
            inst.prometheus = sink
            inst.port = sink.port
            inst.sinks.append(sink)
            if ex.file_sd_path:
                try:
                    write_file_sd(inst, sink)
                except OSError as e:
                    from distgrad.config import ConfigError

                    err = ConfigError(f"distgrad config: 'exporter.file_sd_path' = "
                                      f"{ex.file_sd_path!r} cannot be written: {type(e).__name__}: {e}; "
                                      "choose a writable path (a directory Prometheus reads) or set it to null")
                    err.__cause__ = e
        except OSError as e:
            err = e
    if inst.global_rank == 0 and err is None:
        err = start_file_sinks(inst)
    if inst.prometheus is not None:
        names = [sink.name for sink in inst.sinks] + (["flight_recorder"] if inst.config.flight_recorder.dir else [])
        for name in names:  # labelled counters at 0 from the start, like the others
            inst.prometheus.collector.inc_labeled("distgrad_sink_errors", {"sink": name}, 0)
        for reason in metrics.LABELS["reason"].values or ():
            inst.prometheus.collector.inc_labeled("distgrad_refused_steps", {"reason": reason}, 0)
        if inst.action.active:
            for cause in metrics.LABELS["cause"].values or ():
                inst.prometheus.collector.inc_labeled("distgrad_action_skipped_steps", {"cause": cause}, 0)
    agree(inst, err)


def agree(inst: Instrument, err: BaseException | None = None) -> None:
    """The set-up agreement: one small MAX all-reduce at ``instrument()`` time, made by every
    rank -- a rank with ``enabled: false`` too, before it returns its inert instrument -- so that
    set-up failing on one rank (``err``), a different number of trainable parameters, or
    different settings that decide the collectives (``enabled``, ``interval``,
    ``replica_check``, ``update_ratio``, the packed signals and their sizes) raise on every rank instead of a
    deadlock later.

    Raises:
        ``err`` or RuntimeError naming the disagreement (after ``inst.close()``)."""
    if dist_ready() and inst.world_size > 1:
        h = float(collective_settings_hash(inst))
        flag = torch.tensor([1.0 if err else 0.0, float(inst.layout.n_params), -float(inst.layout.n_params),
                             h, -h], dtype=torch.float64, device=inst.source.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=inst.group)
        f = flag.cpu().tolist()
        if err is None and f[0] > 0:
            err = RuntimeError("distgrad set-up failed on global rank 0 (see its error above)")
        if err is None and f[1] != -f[2]:
            err = RuntimeError(
                f"ranks disagree on the number of trainable parameters ({int(-f[2])}..{int(f[1])}): "
                "every rank must instrument the same model with the same requires_grad settings")
        if err is None and f[3] != -f[4]:
            c = inst.config
            err = RuntimeError(
                f"ranks disagree on distgrad settings that decide its collectives (this rank, "
                f"{inst.global_rank}: enabled={c.enabled}, sampling.interval={c.sampling.interval}, "
                f"statistics.replica_check={c.statistics.replica_check}, update_ratio={c.statistics.update_ratio}, "
                f"async_records={c.statistics.async_records}, loss.sources={c.loss.sources}, packed signals="
                f"{[s.name for s in inst.signals.signals]}, action.on_nonfinite={c.action.on_nonfinite}, "
                f"action.on_spike={c.action.on_spike}, tracer.replays={c.tracer.replays}): every rank must call "
                "distgrad.instrument() with the same config (enabled: false on every rank or none), or "
                "the job would deadlock at the first sampled step")
    if err is not None:
        inst.close()
        raise err


def collective_settings_hash(inst: Instrument) -> int:
    """Settings that decide which collectives a rank makes, hashed to an integer exactly
    representable in float64 (for the set-up agreement all-reduce)."""
    import hashlib

    c = inst.config
    st = c.statistics
    sig = getattr(inst, "signals", None)  # the packed signals and their sizes (distgrad.signals)
    signals = tuple((s.name, s.sum_size, s.max_size) for s in sig.signals) if sig is not None else ()
    key = repr((c.enabled, c.sampling.interval, st.replica_check, st.update_ratio, inst.async_records,
                tuple(c.loss.sources), signals, c.action.on_nonfinite, c.action.on_spike, c.tracer.replays)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:6], "big")


def file_sd_file(file_sd_path: str, run_name: str | None, host: str, port: int) -> str:
    """The file rank 0 writes for ``exporter.file_sd_path``: the path itself, or, when it is an
    existing directory or ends with ``/``, ``<dir>/distgrad-<run_name or "run">-<host>-<port>.json``
    (characters other than letters, digits, ``.``, ``_``, ``-`` become ``_``), so that many runs
    and nodes share one directory that Prometheus globs (``<dir>/*.json``)."""
    import os
    import re

    path = str(file_sd_path)
    if path.endswith(os.sep) or os.path.isdir(path):
        name = re.sub(r"[^A-Za-z0-9._-]", "_", f"distgrad-{run_name or 'run'}-{host}-{port}") + ".json"
        path = os.path.join(path, name)
    return path


def reachable_host() -> str:
    """A name or address of this machine that other hosts can reach, for the file_sd target of
    an exporter bound to all interfaces: the FQDN when it resolves to a non-loopback address;
    else the address of the interface that routes to the job's rendezvous host
    (``$MASTER_ADDR``, else a public address; a UDP ``connect`` sends nothing); else the host
    name. (On many containers and VMs the FQDN is ``localhost``.)"""
    import os
    import socket

    fqdn = socket.getfqdn()
    try:
        addrs = {str(info[4][0]) for info in socket.getaddrinfo(fqdn, None)}
        if fqdn != "localhost" and any(not (a.startswith("127.") or a == "::1") for a in addrs):
            return fqdn
    except OSError:
        pass
    peer = os.environ.get("MASTER_ADDR") or "192.0.2.1"  # TEST-NET-1: routed like any public address
    try:
        with socket.socket(socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, 9))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostname()


def write_file_sd(inst: Instrument, sink: PrometheusSink) -> None:
    """Write rank 0's exporter ``sink`` as a Prometheus file_sd target (atomically: write + rename) at
    :func:`file_sd_file` of ``exporter.file_sd_path``: ``[{"targets": ["<host>:<port>"],
    "labels": {"run": run_name}}]`` with host ``exporter.advertise_host``, else the bound
    address, else (bound to all interfaces) :func:`reachable_host`. The exporter removes the file
    at a clean end, after its final state was scraped (:meth:`PrometheusSink.close`); a crashed
    run leaves it, so that Prometheus keeps finding the dead target and the alert pages."""
    import json
    import os

    ex = inst.config.exporter
    host = ex.advertise_host or (ex.host if ex.host not in ("0.0.0.0", "::", "") else reachable_host())
    entry: dict[str, Any] = {"targets": [f"{host}:{sink.port}"]}
    if ex.run_name:
        entry["labels"] = {"run": ex.run_name}
    path = file_sd_file(str(ex.file_sd_path), ex.run_name, host, sink.port)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump([entry], f)
    os.replace(tmp, path)
    sink.file_sd_path = path


def start_file_sinks(inst: Instrument) -> BaseException | None:
    """Open rank 0's file outputs now, so that an unwritable path fails at ``instrument()``
    time with the config key named."""
    from distgrad.config import ConfigError

    sinks, fr = inst.config.sinks, inst.config.flight_recorder
    key, value = "", None
    try:
        if sinks.jsonl.path:
            from distgrad.export.jsonl import JsonlSink

            key, value = "sinks.jsonl.path", sinks.jsonl.path
            inst.sinks.append(JsonlSink(sinks.jsonl.path, max_bytes=sinks.jsonl.max_bytes,
                                        backups=sinks.jsonl.backups))
        if sinks.tensorboard.dir:
            from distgrad.export.tensorboard import TensorBoardSink

            key, value = "sinks.tensorboard.dir", sinks.tensorboard.dir
            inst.sinks.append(TensorBoardSink(sinks.tensorboard.dir, naming_rules=inst.config.naming.tuples))
        if fr.dir:
            import os
            import tempfile

            key, value = "flight_recorder.dir", fr.dir
            os.makedirs(fr.dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=fr.dir):
                pass
    except Exception as e:  # noqa: BLE001 - reported at instrument() time
        err = ConfigError(f"distgrad config: {key!r} = {value!r} cannot be used: "
                          f"{type(e).__name__}: {e}; choose a writable path or set it to null")
        err.__cause__ = e
        return err
    return None
