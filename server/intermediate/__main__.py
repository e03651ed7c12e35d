"""Run one DDP-SA intermediate aggregation server as its own OS process.

    python -m server.intermediate --host 127.0.0.1 --port 50151 \
        --tls-cert intermediate.pem --tls-key intermediate.key \
        --roster roster.json --server-identity parameter-server.pub

TLS with a certificate from the deployment's CA is mandatory; ``--roster`` lists the clients that
may push (``cancelfl keys roster``), ``--server-identity`` is the parameter server's public identity
file (``cancelfl keys gen``): the only caller that may register runs and read partial sums.

``--port 0`` binds a free ephemeral port; the bound port is logged and, with
``--port-file``, written atomically to that file (used by :mod:`.launcher`).
SIGTERM/SIGINT stop the server gracefully.  With ``--parent-pid`` the server also exits
when that process disappears, so crashed test runs leave no orphan servers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from protocols.identity import IdentityError
from protocols.wire.intermediate.auth import AccessPolicy
from server.intermediate.servicer import (
    DEFAULT_MAX_MESSAGE_BYTES,
    IntermediateAggregatorServicer,
    Limits,
    create_server,
    format_address,
)

log = logging.getLogger("server.intermediate")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m server.intermediate",
        description="DDP-SA intermediate aggregation server (gRPC).",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 = free ephemeral port")
    p.add_argument("--server-id", default="", help="identifier reported to the parameter server")
    p.add_argument("--tls-cert", required=True, help="PEM server certificate from the deployment's CA")
    p.add_argument("--tls-key", required=True, help="PEM private key of --tls-cert")
    p.add_argument("--roster", required=True, help="roster of the clients that may push (cancelfl keys roster)")
    p.add_argument("--server-identity", required=True,
                   help="public identity file of the parameter server (cancelfl keys gen)")
    limits = Limits()
    for name in ("keep_rounds", "min_clients", "max_runs", "max_clients", "max_share_bytes", "max_run_bytes",
                 "max_stored_bytes"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(limits, name))
    p.add_argument("--run-idle-s", type=float, default=limits.run_idle_s)
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--port-file", default=None, help="write the bound port to this file")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this pid dies")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    try:
        policy = AccessPolicy.load(args.roster, args.server_identity)
        with open(args.tls_cert, "rb") as f:
            cert = f.read()
        with open(args.tls_key, "rb") as f:
            key = f.read()
        limits = Limits(**{k: getattr(args, k) for k in Limits.__dataclass_fields__})
    except (OSError, IdentityError, ValueError) as err:
        log.error("cannot start: %s", err)
        return 2
    servicer = IntermediateAggregatorServicer(policy, server_id=args.server_id, limits=limits)
    server, port = create_server(servicer, certificate=cert, private_key=key, host=args.host, port=args.port,
                                 max_workers=args.max_workers, max_message_bytes=args.max_message_bytes)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("received signal %d, shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    if args.parent_pid is not None:
        parent = args.parent_pid

        is_direct_parent = os.getppid() == parent

        def _parent_alive() -> bool:
            if is_direct_parent:  # reparenting is the reliable signal for our own parent
                return os.getppid() == parent
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True

        def _watch_parent() -> None:
            while not stop.wait(0.5):
                if not _parent_alive():
                    log.warning("parent process %d is gone, shutting down", parent)
                    stop.set()

        threading.Thread(target=_watch_parent, daemon=True).start()

    if args.port_file:
        _write_port_file(args.port_file, port)
    log.info("intermediate server %r listening on %s (TLS; %d roster clients)", args.server_id,
             format_address(args.host, port), len(policy.clients))
    while not stop.wait(1.0):  # timed wait so signal handlers run promptly
        pass
    server.stop(grace=1.0).wait()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
