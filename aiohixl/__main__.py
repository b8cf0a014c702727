"""Command line: ``python -m aiohixl info|bench|store`` (and the ``aiohixl`` console script)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiohixl", description="aiohixl command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, transports available here and why not, RDMA devices")
    sub.add_parser("bench", help="latency, bandwidth and CPU against baselines (bench --help)", add_help=False)
    store = sub.add_parser(
        "store", help="run the tcp rendezvous store alone (ranks connect with store=tcp://HOST:PORT)"
    )
    store.add_argument("--listen", required=True, metavar="HOST:PORT", help="where to listen (port 0: a free one)")
    store.add_argument("--token", default=None, help="the agents' shared token (default: AIOHIXL_TOKEN)")
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
    elif args.command == "store":
        return _store(args.listen, args.token)
    return 0


def _store(listen: str, token: str | None) -> int:
    import anyio

    from ._control import handshake as c
    from .errors import InvalidArgument
    from .ranks import StoreServer

    try:
        host, port = c.parse_address(listen, "aiohixl store --listen")
        server = StoreServer(host, port, c.resolve_token(token, "aiohixl store", "--token"))
    except InvalidArgument as exc:
        print(exc, file=sys.stderr)  # it names "aiohixl store" already
        return 2

    async def run() -> None:
        async def announce() -> None:
            while server.address is None:
                await anyio.sleep(0.01)
            print(f"aiohixl store listening on tcp://{server.address}", flush=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(announce)
            await server.serve_forever()

    try:
        anyio.run(run)
    except OSError as exc:
        print(f"aiohixl store: cannot listen on {listen}: {exc.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
