"""``distgrad`` command line: offline reports of JSONL run logs.

Subcommands::

    distgrad report RUN.jsonl -o DIR [--max-points N] [--title T] [--no-rotated] [--fail-on-problem]
    distgrad summary RUN.jsonl [--top N] [--no-rotated] [--fail-on-problem]

Exit status: 0 success; 1 the log cannot be read (missing, malformed) or a dependency is
missing; 2 usage error; 3 with ``--fail-on-problem`` when the verdict is not healthy.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit status (see module doc)."""
    parser = _parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE

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
