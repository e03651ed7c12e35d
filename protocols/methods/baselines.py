"""The baselines' cards: FedAvg (no DP), local DP and central DP."""

from __future__ import annotations

from protocols.methods.common import MODEL, MODEL_TRUSTED, RECORD_STEP, ROUND_GOALS, SERVER
from protocols.methods.registry import register
from protocols.methods.spec import PRIVACY_UNITS, Guarantee, MethodSpec

#: FedAvg trains with the run-config defaults; on MNIST-size data fewer, shorter rounds keep a run to minutes.
FEDAVG_REGIME = {"large": {"num-rounds": 10, "local-epochs": 1}}
#: ldp at record level: the record step, fewer rounds (every client's noise stays in the mean and grows with T under
#: composition while later rounds' clipped gradients shrink).
LDP_REGIME = {"small": {**RECORD_STEP["small"], "num-rounds": 10}, "large": {"num-rounds": 20}}
#: ldp's and cdp's privacy-audit adapters (fedavg claims nothing: not auditable).
LDP_AUDIT, CDP_AUDIT = "server.audits.baselines:LdpAudit", "server.audits.baselines:CdpAudit"

# FedAvg (no DP) is the arm the benchmarks measure the others against.
register(MethodSpec("fedavg", "strategies.baselines:FedAvgStrategy", "client.methods.baselines:train_fedavg",
                    regime=FEDAVG_REGIME, units=(), reference=True))
register(MethodSpec("ldp", "strategies.baselines:LocalDPStrategy", "client.methods.baselines:train_ldp",
                    regime=LDP_REGIME, privacy=Guarantee("record", SERVER, MODEL), units=PRIVACY_UNITS,
                    audit=LDP_AUDIT, **ROUND_GOALS))
register(MethodSpec("cdp", "strategies.baselines:CentralDPStrategy", "client.methods.baselines:train_cdp",
                    regime=RECORD_STEP, privacy=Guarantee("record", None, MODEL_TRUSTED), units=PRIVACY_UNITS,
                    audit=CDP_AUDIT, **ROUND_GOALS))
