"""Micro-benchmarks of the protocol core (single thread).

Run: ``python tests/benchmarks/bench_protocol_core.py [--quick]``

Prints
* noise-engine throughput (samples/s) of ``protocols.prg`` for Gaussian, Laplace, uniform and
  integer vectors at several lengths (best of several repeats; includes allocating the
  output array, as callers do), with numpy's non-cryptographic PCG64 for reference;
* key agreement + pair-seed derivation time per client for 100 and 1000 peers
  (X25519 exchange + HKDF-SHA256 for each peer);
* one client's pairwise noise with 100 peers on a 1e5-dimensional model.
"""

from __future__ import annotations

import os

# Pin every numerical library to one thread before numpy is imported: the figures are per core.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocols.keyagreement import agree, derive_pair_seed, generate_keypair  # noqa: E402
from protocols.pairwise import pairwise_noise  # noqa: E402
from protocols.prg import gaussian, laplace, uniform, uniform_ints  # noqa: E402

SEED = hashlib.sha256(b"bench").digest()


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Minimum wall time of ``repeats`` calls after one warm-up (robust to a shared machine)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_prg(quick: bool) -> None:
    sizes = [10**5, 10**6] if quick else [10**5, 10**6, 10**7]
    pcg = np.random.default_rng(0)
    cases: list[tuple[str, Callable[[int], object]]] = [
        ("gaussian (AES-CTR ziggurat)", lambda n: gaussian(SEED, n)),
        ("laplace (AES-CTR ziggurat)", lambda n: laplace(SEED, n)),
        ("uniform 53-bit (AES-CTR)", lambda n: uniform(SEED, n)),
        ("uniform_ints mod 10^9+7", lambda n: uniform_ints(SEED, n, 10**9 + 7)),
        ("[ref] numpy PCG64 normal", lambda n: pcg.standard_normal(n)),
    ]
    print("\n== noise engine, single thread (samples/s, best of repeats) ==")
    print(f"{'generator':32s}" + "".join(f"{'n=' + format(n, '.0e'):>12s}" for n in sizes))
    for name, fn in cases:
        row = []
        for n in sizes:
            repeats = max(3, min(30, 2 * 10**7 // n)) if not quick else 3
            row.append(n / best_time(lambda fn=fn, n=n: fn(n), repeats))
        print(f"{name:32s}" + "".join(f"{r / 1e6:10.1f} M" for r in row))


def bench_key_agreement(peers: int, repeats: int) -> tuple[float, float]:
    """Seconds per client for X25519 + HKDF with ``peers`` peers; (total, X25519 only)."""
    own = generate_keypair()
    publics = [generate_keypair().public_bytes for _ in range(peers)]
    own_id = 10**12

    def full() -> None:
        for j, pub in enumerate(publics):
            shared = agree(own, pub)
            derive_pair_seed(shared, purpose="noise", round_num=1, node_a=own_id, node_b=j, context=b"run")

    def dh_only() -> None:
        for pub in publics:
            agree(own, pub)

    return best_time(full, repeats), best_time(dh_only, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args()
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, {platform.processor() or ''}")
    bench_prg(args.quick)

    print("\n== key agreement + seed derivation per client ==")
    for peers in (100, 1000):
        total, dh = bench_key_agreement(peers, repeats=3 if args.quick else 5)
        print(
            f"{peers:5d} peers: {total * 1e3:8.2f} ms per client "
            f"({total / peers * 1e6:6.1f} us/peer; X25519 {dh / peers * 1e6:5.1f} us, HKDF {(total - dh) / peers * 1e6:5.1f} us)"
        )

    print("\n== pairwise noise, one client ==")
    dim, peers = 10**5, 100
    seeds = {j: hashlib.sha256(j.to_bytes(4, "big")).digest() for j in range(1, peers + 1)}
    t = best_time(lambda: pairwise_noise(0, seeds, dim), 3)
    rate = peers * dim / t / 1e6
    print(f"{peers} peers x {dim:.0e} dims (gaussian): {t * 1e3:.1f} ms ({rate:.1f} M samples/s incl. accumulation)")


if __name__ == "__main__":
    main()
