"""Privacy attacks used by the benchmark: gradient inversion (uplink) and membership inference (downlink)."""
