"""The ServerApp: NadpStrategy built from the app's settings, run by Strategy.start()."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from nadp_app.task import Net, load_data, settings
from strategies import NadpStrategy

app = ServerApp()


def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy and loss of the global model on the held-out test split."""
    _, _, x_test, y_test = load_data()
    model = Net()
    model.load_state_dict({k: torch.as_tensor(v.numpy()) for k, v in arrays.items()})
    with torch.no_grad():
        logits = model(torch.as_tensor(x_test))
        loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(y_test)).item()
        acc = (logits.argmax(1).numpy() == y_test).mean().item()
    print(f"round {server_round}: test accuracy {acc:.3f} loss {loss:.3f}", flush=True)
    return MetricRecord({"accuracy": acc, "loss": loss})


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the strategy from the settings (ConfigError names a bad key) and run it."""
    strategy = NadpStrategy(**settings(context.run_config))
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), evaluate_fn=evaluate_fn)
    report = strategy.privacy_report(strategy.cfg.num_rounds)
    print(f"epsilon spent: upload {report['epsilon_uplink']:.3f}, model {report['epsilon_downlink']:.3f}", flush=True)
