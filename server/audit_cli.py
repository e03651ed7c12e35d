"""``cancelfl audit``: its options and its exit code (0 = no violation, 1 = violation, 2 = refused).

Its options and help load no torch, Flower or accountant (the method adapters and the audit itself load when
an audit runs), so ``cancelfl audit --help`` answers in well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from protocols.config import ConfigError, parse_run_config
from server.audit_faults import HALVE_NOISE
from server.audit_spec import (
    ADJACENCY_TEXT,
    CANARIES,
    DIRECTIONS,
    AuditSpec,
    auditable_methods,
    default_direction,
    federation,
)
from server.cli_text import methods_text

__all__ = ["DESCRIPTION", "add_arguments", "epilog", "main"]

DESCRIPTION = """\
Check a method's privacy claim on its real release code: plant canary records in the
clients' data, run one training round many times, and bound from below (95 % confidence)
the epsilon an adversary who sees the uploads (--direction upload) or the published model
(--direction model) can prove.  The claim checked is the run's own epsilon after one round
at --epsilon for that view (niss uploads without --colluders: its figure for uploads with no
colluding neighbour; with colluders: its claim, which covers floor(niss-rho x neighbours)).

Examples:
  cancelfl audit --method nadp                      the uploads, the method's own canaries (minutes)
  cancelfl audit --method nadp --direction model    the published model
  cancelfl audit --method ldp --fault halve-noise   self-test: a planted fault must be flagged
  cancelfl audit --method cdp --fault halve-noise   ... in the view whose claim it breaks (here: model)

Exit status: 0 no violation, 1 the audit proves more privacy loss than claimed (VIOLATION),
2 refused (a bad option, named).
"""


def epilog() -> str:
    """The auditable methods, one line each (what their epsilon protects)."""
    return f"methods that can be audited:\n{methods_text(auditable_methods())}\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl audit``; the defaults shown are the real ones (:class:`AuditSpec`)."""
    d = AuditSpec("")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description, p.epilog = DESCRIPTION, epilog()
    p.add_argument("--method", required=True, help="method to audit (list below)")
    p.add_argument("--direction", choices=DIRECTIONS, default=None,
                   help=f"upload: what the server holds of the uploads; model: the published model "
                        f"(default: {d.direction}); with --fault, the view whose claim the fault breaks (model for "
                        "cdp and the MP family)")
    p.add_argument("--epsilon", type=float, default=d.epsilon,
                   help=f"the run's privacy target; its one-round epsilon is the claim audited (default: {d.epsilon})")
    p.add_argument("--trials", type=int, default=None,
                   help=f"canary records over all releases (default: the method's own, most {d.trials:,}; with "
                        "--fault, its self-test's)")
    p.add_argument("--canary", choices=CANARIES, default=None,
                   help="gradient: canaries with large gradients; adaptive: canaries that move a noise scale "
                        "computed from the data (default: the method's own, most gradient)")
    p.add_argument("--colluders", type=int, default=d.colluders,
                   help=f"upload view: clients that hand the server their pair noise (default: {d.colluders})")
    p.add_argument("--fault", metavar="NAME", default=None,
                   help=f"self-test: plant a fault in the release code that the audit must flag, e.g. "
                        f"{HALVE_NOISE} (every method that adds noise); a name the method lacks is refused with "
                        "its list (default: none)")
    p.add_argument("--clients", type=int, default=None,
                   help=f"clients per release (default: the method's own, most {d.clients})")
    p.add_argument("--per-client", type=int, default=None,
                   help=f"canaries per client and release (default: the method's own, most {d.per_client})")
    p.add_argument("--adjacency", choices=tuple(ADJACENCY_TEXT), default=None,
                   help="neighbouring datasets of the claim and the canaries (default: zero-out; with adaptive "
                        "canaries replace-one)")
    p.add_argument("--rounds", type=int, default=1,
                   help="the run's num-rounds (its calibration and schedule); the audit releases its first round (default: 1)")
    p.add_argument("--set", nargs="*", default=None, metavar="KEY=VALUE",
                   help="further run-config of the audited run (TOML values), e.g. ddpsa-composition='\"pld\"'")
    p.add_argument("--given-secret", action="store_true",
                   help="model view read with the release's secret (MP family: R), every canary counted")
    p.add_argument("--json", default="", help="also write the report as JSON to this file")


def main(args: argparse.Namespace) -> int:
    """``cancelfl audit``: 0 = no violation, 1 = the audit proves more privacy loss than claimed, 2 = refused."""
    try:
        direction = args.direction or default_direction(args.method, args.fault)
        fed = federation(args.method, direction, args.canary, args.given_secret, args.fault)
        settings = tuple(parse_run_config(" ".join(args.set)).items()) if args.set else ()
        spec = AuditSpec(args.method, direction, args.epsilon, args.trials or fed["trials"], args.canary,
                         args.colluders, args.fault, args.clients or fed["clients"], args.per_client or fed["per_client"],
                         adjacency=args.adjacency, rounds=args.rounds, settings=settings,
                         given_secret=args.given_secret)
        spec.validate()
    except ConfigError as err:
        print(f"cancelfl audit: {err}", file=sys.stderr)
        return 2
    from server.audit import run_audit  # torch, Flower and the accountants: only for an audit that runs

    report = run_audit(spec, progress=lambda s: print(f"cancelfl audit: {s}", file=sys.stderr))
    print(report.line())
    for note in report.notes:
        print(f"  {note}; adjacency: {report.adjacency}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 1 if report.violation else 0
