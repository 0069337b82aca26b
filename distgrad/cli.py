"""``distgrad`` command line: offline reports of JSONL run logs.

Subcommands::

    distgrad report RUN.jsonl -o DIR [--max-points N] [--title T] [--no-rotated] [--fail-on-problem]
    distgrad summary RUN.jsonl [--top N] [--no-rotated] [--fail-on-problem]
    distgrad landscape MODULE:FUNCTION -o DIR [--checkpoint PATH] [--steps N] [--span S] [--seed K] [--2d]

Exit status: 0 success; 1 the log cannot be read (missing, malformed) or a dependency is
missing; 2 usage error; 3 with ``--fail-on-problem`` when the verdict is not healthy.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PROBLEM = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distgrad", description="Gradient-statistics reports for distgrad run logs.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("run", help="JSONL run log written by JsonlSink (rotated RUN.N files are read too)")
        sp.add_argument("--no-rotated", action="store_true", help="ignore the rotated RUN.N files")
        sp.add_argument("--fail-on-problem", action="store_true",
                        help=f"exit with status {EXIT_PROBLEM} when the verdict is not HEALTHY")
        sp.add_argument("--overflow-streak", type=int, default=20, metavar="N",
                        help="consecutive fp16 overflow steps counted as a problem (default 20)")

    r = sub.add_parser("report", help="write PNG plots and a self-contained HTML report")
    common(r)
    r.add_argument("-o", "--out-dir", required=True, help="output directory (created if missing)")
    r.add_argument("--max-points", type=int, default=1024,
                   help="downsampling buckets per plot (even, default 1024)")
    r.add_argument("--title", default=None, help="report title")

    s = sub.add_parser("summary", help="print a plain-text summary table")
    common(s)
    s.add_argument("--top", type=int, default=10, help="worst layers listed (default 10)")

    ls = sub.add_parser("landscape", help="loss-landscape slice (Li et al. 2018) of a model: JSON + PNG")
    ls.add_argument("factory", help="MODULE:FUNCTION returning (model, loss_fn, batches); called with "
                    "checkpoint=PATH when --checkpoint is given. loss_fn(model, batch) -> scalar loss")
    ls.add_argument("-o", "--out-dir", required=True, help="output directory (created if missing)")
    ls.add_argument("--checkpoint", default=None, help="passed to the factory as checkpoint=")
    ls.add_argument("--steps", type=int, default=21, help="grid points per axis (default 21)")
    ls.add_argument("--span", type=float, default=1.0, help="coefficients in [-span, span] (default 1.0)")
    ls.add_argument("--seed", type=int, default=0, help="direction seed (default 0)")
    ls.add_argument("--2d", dest="two_d", action="store_true", help="2-D slice along two directions")
    ls.add_argument("--one-d", choices=("zero", "weights"), default="zero",
                    help="direction of 1-D parameters (biases, norms): zero (default) or the weights")
    ls.add_argument("--include-frozen", action="store_true", help="also perturb requires_grad=False parameters")
    return p


def _landscape(args: argparse.Namespace) -> int:
    """``distgrad landscape``: build the model with the factory, slice, write landscape.json and
    landscape.png (rank 0 of a distributed job; every rank runs the command, e.g. under torchrun)."""
    import importlib
    import json
    from pathlib import Path

    from distgrad.report import landscape as ls

    mod_name, _, fn_name = args.factory.partition(":")
    if not mod_name or not fn_name:
        print(f"distgrad: error: factory must be MODULE:FUNCTION, got {args.factory!r}", file=sys.stderr)
        return EXIT_USAGE
    # a console script's sys.path lacks the working directory: import MODULE from it, as
    # ``python -m`` would (docs/landscape.md)
    if not {"", os.getcwd()} & set(sys.path):
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
        built = fn(checkpoint=args.checkpoint) if args.checkpoint else fn()
        model, loss_fn, batches = built
        kw = dict(steps=args.steps, span=args.span, seed=args.seed, one_d=args.one_d,
                  include_frozen=args.include_frozen)
        res = (ls.slice_2d if args.two_d else ls.slice_1d)(model, loss_fn, batches, **kw)
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as e:
        print(f"distgrad: error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return EXIT_OK
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "landscape.json").write_text(json.dumps(res.to_dict(), indent=1))
    try:
        ls.plot(res, str(out / "landscape.png"))
    except ImportError as e:
        print(f"distgrad: {e} (install the report extra for the PNG: pip install 'distgrad[report]')", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {out / 'landscape.json'} and {out / 'landscape.png'} (centre loss {res.center:.6g})")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit status (see module doc)."""
    parser = _parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if args.command == "landscape":
        return _landscape(args)

    from distgrad import report as rep

    try:
        if args.command == "summary":
            a = rep.analyze(args.run, include_rotated=not args.no_rotated,
                            overflow_streak_limit=args.overflow_streak)
            sys.stdout.write(rep.format_summary(a, top=args.top))
        else:
            if args.max_points < 2 or args.max_points % 2:
                parser.error("--max-points must be an even number >= 2")
            a = rep.analyze(args.run, max_points=args.max_points, include_rotated=not args.no_rotated,
                            overflow_streak_limit=args.overflow_streak)
            res = rep.write_report(args.run, args.out_dir, title=args.title, analysis=a)
            print(a.verdict())
            print(f"wrote {res.html} and {len(res.pngs)} PNG file(s) to {res.out_dir}")
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    except ImportError as e:
        print(f"distgrad: {e} (install the report extra: pip install 'distgrad[report]')", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ValueError) as e:
        print(f"distgrad: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if args.fail_on_problem and not (a.healthy and a.n_records > 0):
        return EXIT_PROBLEM
    return EXIT_OK


if __name__ == "__main__":  # python -m distgrad.cli
    sys.exit(main())
