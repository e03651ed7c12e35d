"""Micro-benchmarks of the protocol core (single thread).

    cancelfl-bench protocol-core [--quick] [--keys-only]

Prints
* noise-engine throughput (samples/s) of ``protocols.prg`` for Gaussian, Laplace, uniform and
  integer vectors at several lengths (best of several repeats; includes allocating the
  output array, as callers do), with numpy's non-cryptographic PCG64 for reference;
* key agreement + pair-seed derivation time per client for 100 and 1000 peers
  (X25519 exchange + HKDF-SHA256 for each peer), and next to it the added cost of
  authentication (:mod:`protocols.identity`): one Ed25519 signature over the client's
  own key statement, one verification per peer against the roster, and the round's
  view digest over the participant list;
* one client's pairwise noise with 100 peers on a 1e5-dimensional model.

Every numerical library is pinned to one thread (:mod:`benchmarks`): the figures are per core.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import time
from collections.abc import Callable

import numpy as np

from protocols.identity import Roster, generate_identity, key_statement, verify_key, view_digest
from protocols.keyagreement import agree, derive_pair_seed, generate_keypair
from protocols.pairwise import pairwise_noise
from protocols.prg import gaussian, laplace, uniform, uniform_ints

HELP = "noise-engine throughput, key agreement and pairwise noise (single thread)"

SEED = hashlib.sha256(b"bench").digest()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``cancelfl-bench protocol-core``."""
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--keys-only", action="store_true", help="only key agreement and authentication")


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
    """Samples per second of each generator at several vector lengths."""
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


def bench_authentication(peers: int, repeats: int) -> tuple[float, float, float]:
    """Seconds per client for (signing its own key, verifying ``peers`` signed keys, the view digest)."""
    identities = [generate_identity(f"node-{j}") for j in range(peers + 1)]
    roster = Roster({i.name: i.public_bytes for i in identities})
    keys = [generate_keypair().public_bytes for _ in range(peers + 1)]
    ids = [10**12 + j for j in range(peers + 1)]
    stmt = [dict(run_id=1, key_epoch=0, name=identities[j].name, node_id=ids[j], x25519_public=keys[j])
            for j in range(peers + 1)]
    sigs = [identities[j].sign(key_statement(**stmt[j])) for j in range(peers + 1)]

    def sign() -> None:
        identities[0].sign(key_statement(**stmt[0]))

    def verify() -> None:
        for j in range(1, peers + 1):
            verify_key(roster, signature=sigs[j], **stmt[j])

    def digest() -> None:
        view_digest(run_id=1, round_num=1, key_epoch=0, graph="complete", n_out=0, graph_seed=SEED, participants=ids)

    return best_time(sign, repeats * 10), best_time(verify, repeats), best_time(digest, repeats * 10)


def run(args: argparse.Namespace) -> int:
    """Print the three micro-benchmarks."""
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, {platform.processor() or ''}")
    if not args.keys_only:
        bench_prg(args.quick)

    print("\n== key agreement + seed derivation per client ==")
    for peers in (100, 1000):
        total, dh = bench_key_agreement(peers, repeats=3 if args.quick else 5)
        print(
            f"{peers:5d} peers: {total * 1e3:8.2f} ms per client "
            f"({total / peers * 1e6:6.1f} us/peer; X25519 {dh / peers * 1e6:5.1f} us, HKDF {(total - dh) / peers * 1e6:5.1f} us)"
        )
        sign, verify, digest = bench_authentication(peers, repeats=3 if args.quick else 5)
        print(
            f"{'':5s}  + authentication: {(sign + verify + digest) * 1e3:8.2f} ms per client "
            f"(Ed25519 sign own key {sign * 1e6:5.1f} us once; verify {verify / peers * 1e6:5.1f} us/peer; "
            f"view digest over {peers + 1} ids {digest * 1e6:6.1f} us) = {(sign + verify + digest) / dh:4.2f}x the X25519 cost"
        )

    if args.keys_only:
        return 0
    print("\n== pairwise noise, one client ==")
    dim, peers = 10**5, 100
    seeds = {j: hashlib.sha256(j.to_bytes(4, "big")).digest() for j in range(1, peers + 1)}
    t = best_time(lambda: pairwise_noise(0, seeds, dim), 3)
    rate = peers * dim / t / 1e6
    print(f"{peers} peers x {dim:.0e} dims (gaussian): {t * 1e3:.1f} ms ({rate:.1f} M samples/s incl. accumulation)")
    return 0
