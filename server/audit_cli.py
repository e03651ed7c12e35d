"""``cancelfl audit``: its options and its exit code (0 = no violation, 1 = violation, 2 = refused)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from protocols.config import ConfigError, parse_run_config
from server.audit import run_audit
from server.audit_spec import ADJACENCY_TEXT, CANARIES, DIRECTIONS, AuditSpec, auditable_methods, faults, federation

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl audit``."""
    p.add_argument("--method", required=True, help=f"method to audit ({', '.join(auditable_methods())})")
    p.add_argument("--direction", choices=DIRECTIONS, default="upload",
                   help="upload: what the server holds of the uploads; model: the published aggregate")
    p.add_argument("--epsilon", type=float, default=4.0, help="the run's epsilon (one round: the audited claim)")
    p.add_argument("--trials", type=int, default=None, help="canary records over all releases (default: per method)")
    p.add_argument("--canary", choices=CANARIES, default=None,
                   help="gradient: white-box gradient canaries; adaptive: a data-dependent noise scale (default: per method)")
    p.add_argument("--colluders", type=int, default=0, help="upload view: peers handing the server their pair material")
    p.add_argument("--fault", choices=faults(), default=None, help="plant a fault in the release code (audit self-test)")
    p.add_argument("--clients", type=int, default=None, help="clients per release (default: per method)")
    p.add_argument("--per-client", type=int, default=None, help="canaries per client and release (default: per method)")
    p.add_argument("--adjacency", choices=tuple(ADJACENCY_TEXT), default=None,
                   help="neighbouring datasets of the claim and the canaries (default: zero-out; adaptive: replace-one)")
    p.add_argument("--rounds", type=int, default=1,
                   help="the run's num-rounds (its calibration and schedule); the audit releases its first round")
    p.add_argument("--set", nargs="*", default=None, metavar="KEY=VALUE",
                   help="further run-config of the audited run (TOML values), e.g. ddpsa-composition='\"pld\"'")
    p.add_argument("--given-secret", action="store_true",
                   help="model view read with the release's secret (MP family: R), every canary counted")
    p.add_argument("--json", default="", help="also write the report as JSON to this file")


def main(args: argparse.Namespace) -> int:
    """``cancelfl audit``: 0 = no violation, 1 = the audit proves more privacy loss than claimed, 2 = refused."""
    try:
        fed = federation(args.method, args.direction, args.canary, args.given_secret)
        settings = tuple(parse_run_config(" ".join(args.set)).items()) if args.set else ()
        spec = AuditSpec(args.method, args.direction, args.epsilon, args.trials or fed["trials"], args.canary,
                         args.colluders, args.fault, args.clients or fed["clients"], args.per_client or fed["per_client"],
                         adjacency=args.adjacency, rounds=args.rounds, settings=settings,
                         given_secret=args.given_secret)
        spec.validate()
    except ConfigError as err:
        print(f"cancelfl audit: {err}", file=sys.stderr)
        return 2
    report = run_audit(spec, progress=lambda s: print(f"cancelfl audit: {s}", file=sys.stderr))
    print(report.line())
    for note in report.notes:
        print(f"  {note}; adjacency: {report.adjacency}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 1 if report.violation else 0
