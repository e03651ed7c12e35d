"""``cancelfl-bench``: every benchmark of the project, one module per benchmark.

Across methods (every run goes through the real app in-process, see :mod:`benchmarks.runs`):

* :mod:`~benchmarks.grid`: accuracy / epsilon / time / bytes over methods x epsilon x clients;
* :mod:`~benchmarks.attacks`: DLG on one client's upload (uplink), membership inference (downlink);
* :mod:`~benchmarks.overhead`: client / server time per round vs FedAvg, Flower SecAgg+ reference;
* :mod:`~benchmarks.scale`: per-client cost at 100 / 300 / 1000 simulated clients.

One method against its paper's comparators: :mod:`~benchmarks.nadp`,
:mod:`~benchmarks.niss`, :mod:`~benchmarks.mpddp`, :mod:`~benchmarks.ladp`.
Building blocks: :mod:`~benchmarks.protocol_core` (noise-engine throughput, key agreement) and
:mod:`~benchmarks.clipping` (per-example clipping against Opacus).
:mod:`~benchmarks.cli` dispatches ``cancelfl-bench <benchmark> [options]``
(also ``python -m benchmarks``); shared helpers are in :mod:`~benchmarks.common`.

Threads: importing this package pins BLAS/OpenMP to one thread (``OMP_NUM_THREADS=1`` unless
set), and the CLI sets ``torch.set_num_threads(1)``: multi-threaded kernels only add hand-off overhead on
these tiny models, and the protocol-core figures are per core.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
