"""``kvfabric pool serve`` and ``kvfabric pool status``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

log = logging.getLogger("kvfabric.pool")


def add_parser(sub: argparse._SubParsersAction) -> None:
    pool = sub.add_parser("pool", help="the pool daemon: serve, status")
    psub = pool.add_subparsers(dest="pool_command", required=True)
    serve = psub.add_parser(
        "serve",
        help="run the pool daemon of this node (until SIGTERM)",
        epilog=_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", help="YAML file of pool settings (command-line flags win)")
    serve.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any pool config key (below); repeatable; wins over --config, loses to the flags above",
    )
    serve.add_argument("--name", help="pool name (names the socket and segments)")
    serve.add_argument("--dram", help="DRAM the daemon contributes, e.g. 4GiB (0: none)")
    serve.add_argument("--max-objects", dest="max_objects", help="directory capacity")
    serve.add_argument("--socket", help="Unix socket path for RPC")
    serve.add_argument("--tcp", help="also serve RPC on HOST:PORT")
    serve.add_argument("--token", help="shared secret for TCP clients")
    serve.add_argument("--http", help="HTTP endpoint HOST:PORT (/health, /metrics, /capacity, /keys)")
    serve.add_argument(
        "--exit-when-idle",
        dest="exit_when_idle_s",
        help="exit after this many seconds with no client (default 0: serve until SIGTERM)",
    )
    serve.add_argument("--pause-at", dest="pause_at", help=argparse.SUPPRESS)  # tests: a start-up stage
    serve.set_defaults(fn=cmd_serve)
    status = psub.add_parser("status", help="capacity, ranks and objects of a running daemon")
    status.add_argument("--socket", help="Unix socket path of the daemon")
    status.add_argument("--name", default="default", help="pool name (for the default socket)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(fn=cmd_status)


def _keys_help() -> str:
    """The pool config keys, defaults and meanings (``kvfabric.settings.describe``)."""
    from kvfabric.pool.config import PoolConfig
    from kvfabric.settings import describe

    rows = describe(PoolConfig)
    width = max(len(k) for k, _, _ in rows)
    return "pool config keys (--config YAML, --set KEY=VALUE):\n" + "\n".join(
        f"  {k:<{width}}  {meaning} (default {default})" for k, default, meaning in rows
    )


def _config(args: argparse.Namespace):  # noqa: ANN202 - PoolConfig
    from kvfabric.pool.config import PoolConfig
    from kvfabric.settings import load

    overrides = {
        k: getattr(args, k)
        for k in ("name", "dram", "max_objects", "socket", "tcp", "token", "http", "exit_when_idle_s")
    }
    return load(PoolConfig, None, what="pool config", file=args.config, flags=args.settings, **overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    """Signals are handled from here on, before anything is allocated (``daemon.py``):
    a start interrupted by one cleans up and exits with 128 + the signal's number. A
    start refused or failed for any other expected reason exits with 2 and that reason
    (already running, out of shared memory, ...)."""
    from kvfabric.errors import KVFabricError
    from kvfabric.pool.autostart import UNBIND_ENV, unbind_cpus
    from kvfabric.pool.service.daemon import PoolDaemon, Signals, StartInterrupted
    from kvfabric.pool.service.node import StartStage

    signals = Signals()
    signals.install()
    if os.environ.pop(UNBIND_ENV, None):  # started by autostart, maybe from a pinned process
        unbind_cpus()
    pause_at = StartStage(args.pause_at) if args.pause_at else None
    try:
        daemon = PoolDaemon(_config(args), signals=signals, pause_at=pause_at)
        daemon.start()
    except StartInterrupted as e:
        log.warning("kvfabric pool: %s; nothing was left behind", e)
        return 128 + e.signum
    except (KVFabricError, OSError) as e:  # e.g. a port in use, a socket directory not writable
        print(f"kvfabric pool serve: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"event": "ready", **daemon.endpoints()}), flush=True)
    daemon.serve_forever()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvfabric.errors import ServiceUnavailable
    from kvfabric.pool import protocol as p
    from kvfabric.pool.client.rpc import SocketTransport
    from kvfabric.pool.config import default_socket

    t = SocketTransport(args.socket or default_socket(args.name), timeout=2.0)
    try:
        info = t.call(p.Info()).data
    except ServiceUnavailable as e:
        print(f"kvfabric pool status: {e}", file=sys.stderr)
        return 1
    finally:
        t.close()
    if args.json:
        print(json.dumps(info, default=str))
        return 0
    con = Console()
    con.print(
        f"pool [bold]{info['name']}[/] on {info['platform']}: {info['objects']} objects "
        f"(max {info['max_objects']}), up {info['uptime_s']} s, epoch {info['epoch']:x}"
    )
    tab = Table("rank", "medium", "capacity", "used", "free", "evictions")
    for w in info["capacity"]:
        tab.add_row(
            str(w["rank"]),
            w["medium"],
            f"{w['capacity']:,}",
            f"{w['used']:,}",
            f"{w['free']:,}",
            str(w["evictions"]),
        )
    con.print(tab)
    return 0
