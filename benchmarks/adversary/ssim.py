"""Structural similarity (SSIM, Wang et al. 2004) in numpy, for scoring reconstructions.

Implemented here (no scikit-image dependency) with the usual conventions:
Gaussian window (``sigma = 1.5``), constants ``C1 = (0.01 L)^2`` and
``C2 = (0.03 L)^2`` for data range ``L``, sample (``n - 1``) covariances, and
the mean of the SSIM map over the *valid* window positions (no padding), as
``skimage.metrics.structural_similarity(..., gaussian_weights=True,
use_sample_covariance=True)``.  The window is shrunk to the image side for
small images (digits are 8x8), so SSIM stays defined; with a uniform window as
large as the image it reduces to the single-window formula on global
statistics (what the tests check).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ssim", "ssim_map"]


def _window(size: int, sigma: float | None) -> np.ndarray:
    """1-D normalised window: Gaussian with ``sigma``, or uniform if ``sigma`` is None."""
    if sigma is None:
        w = np.ones(size)
    else:
        r = np.arange(size) - (size - 1) / 2.0
        w = np.exp(-(r**2) / (2.0 * sigma**2))
    return w / w.sum()


def _filter(img: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Separable 'valid' correlation of a 2-D image with the window ``w`` (rows, then columns)."""
    k = len(w)
    rows = np.lib.stride_tricks.sliding_window_view(img, k, axis=0) @ w  # (H-k+1, W)
    return np.lib.stride_tricks.sliding_window_view(rows, k, axis=1) @ w  # (H-k+1, W-k+1)


def ssim_map(x: np.ndarray, y: np.ndarray, *, data_range: float, win_size: int = 7,
             sigma: float | None = 1.5) -> np.ndarray:
    """Local SSIM of two 2-D images over every valid window position."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"ssim_map needs two 2-D images of equal shape, got {x.shape} and {y.shape}")
    if not data_range > 0:
        raise ValueError(f"data_range must be > 0, got {data_range}")
    k = min(win_size, *x.shape)
    w = _window(k, sigma)
    # Unbiased (sample) local covariances, as in Wang et al.'s reference code.
    n_eff = 1.0 / np.sum(np.outer(w, w) ** 2)
    corr = n_eff / (n_eff - 1.0) if n_eff > 1 else 1.0
    mx, my = _filter(x, w), _filter(y, w)
    vx = corr * (_filter(x * x, w) - mx * mx)
    vy = corr * (_filter(y * y, w) - my * my)
    cxy = corr * (_filter(x * y, w) - mx * my)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    return ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))


def ssim(x: np.ndarray, y: np.ndarray, *, data_range: float, win_size: int = 7,
         sigma: float | None = 1.5) -> float:
    """Mean SSIM of two images: (H, W), or (C, H, W) averaged over channels.

    1.0 means identical; values near 0 mean no structural similarity (a random
    or constant guess); negative values mean anti-correlated structure.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"images differ in shape: {x.shape} vs {y.shape}")
    if x.ndim == 2:
        return float(ssim_map(x, y, data_range=data_range, win_size=win_size, sigma=sigma).mean())
    if x.ndim == 3:
        return float(np.mean([ssim_map(a, b, data_range=data_range, win_size=win_size, sigma=sigma).mean()
                              for a, b in zip(x, y, strict=True)]))
    raise ValueError(f"ssim needs (H, W) or (C, H, W) images, got shape {x.shape}")
