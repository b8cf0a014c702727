"""Command line: ``python -m aiohixl info|bench`` (and the ``aiohixl`` console script)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiohixl", description="aiohixl command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, transports available here and why not, RDMA devices")
    sub.add_parser("bench", help="latency, bandwidth and CPU against baselines (bench --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        try:
            from .tools.bench import main as bench_main
        except ImportError as exc:
            print(f"aiohixl bench needs the 'bench' extra (pip install 'aiohixl[bench]'): {exc}", file=sys.stderr)
            return 2
        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        from .tools.info import render

        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
