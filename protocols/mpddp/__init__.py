"""MP_Server + DDP_Client (bidirectional privacy FL): Flower-free math.

Round protocol (paper Algorithm 4), per round t:
  server:  w_hat, secret = mp_server(model, seed)            # send w_hat (2L-1 matrices); keep secret
  client:  up = client_gradients(w_hat, x, onehot_y)           # one gradient at w_hat + Psi, Phi
           up, delta = ddp_client(up, own_id=..., pair_seeds=..., eta_seed=..., sigma_eta=..., sigma_delta=...)
           send up.to_arrays()                                 # 3L arrays
  server:  model, grad = mu_server(model, aggregate([ClientUpload.from_arrays(a) ...]), secret, optimizer)
Noise scales: sigmas_for_theta(theta_for_noise_multiplier(z), K) (Theorem 10, z from an accountant) or
calibrate(epsilon, delta, K, n_out) (one round, Theorems 10/11); ablations calibrate_ldp / calibrate_cdp.
"""

from protocols.mpddp.ablations import add_cdp_noise, clipped_mean, naive_client, naive_gaussian_noise
from protocols.mpddp.calibration import (
    Calibration,
    calibrate,
    calibrate_cdp,
    calibrate_ldp,
    eq23_epsilon,
    given_r_topup,
    mask_reference,
    max_theta,
    mp_record_sensitivity,
    n_out_shortfall,
    round_event,
    round_multiplier,
    satisfies_eq23,
    secret_factor,
    sigmas_for_theta,
    theta_after,
    theta_complete,
    theta_for_noise_multiplier,
    theta_n_out,
)
from protocols.mpddp.ddp import (
    ETA_DISTRIBUTIONS,
    ddp_client,
    delta_variance,
    eta_noise,
    eta_variance,
    flatten,
    pairwise_delta,
    unflatten,
)
from protocols.mpddp.expansion import (
    Layer,
    augment,
    dims_of,
    expand,
    forward_expanded,
    forward_mlp,
    mse_loss,
    one_hot,
    split_blocks,
)
from protocols.mpddp.gradients import (
    ClientUpload,
    client_gradients,
    client_gradients_autograd,
    clipped_client_gradients,
    keeps_records,
    per_example_grad_norms,
)
from protocols.mpddp.perturbation import MPSecret, draw_secret, mp_server, output_scale, perturb, relative_distance
from protocols.mpddp.recovery import aggregate, mu_server, recover, recover_blocks
from protocols.mpddp.samplers import (
    DEFAULT_TERMS,
    Sampler,
    dn_sampler,
    dn_star_cf_error,
    dn_unit_sampler,
    sample_dn,
    sample_dn_star,
)
from protocols.mpddp.threads import torch_threads

__all__ = [
    "DEFAULT_TERMS",
    "Calibration",
    "ClientUpload",
    "Layer",
    "MPSecret",
    "Sampler",
    "add_cdp_noise",
    "clipped_mean",
    "aggregate",
    "augment",
    "calibrate",
    "calibrate_cdp",
    "calibrate_ldp",
    "client_gradients",
    "client_gradients_autograd",
    "clipped_client_gradients",
    "keeps_records",
    "ddp_client",
    "eta_noise",
    "delta_variance",
    "eta_variance",
    "ETA_DISTRIBUTIONS",
    "eq23_epsilon",
    "dims_of",
    "dn_sampler",
    "dn_star_cf_error",
    "dn_unit_sampler",
    "draw_secret",
    "expand",
    "flatten",
    "forward_expanded",
    "forward_mlp",
    "given_r_topup",
    "mask_reference",
    "max_theta",
    "n_out_shortfall",
    "mp_record_sensitivity",
    "mp_server",
    "mse_loss",
    "mu_server",
    "naive_client",
    "naive_gaussian_noise",
    "one_hot",
    "output_scale",
    "per_example_grad_norms",
    "pairwise_delta",
    "perturb",
    "recover",
    "recover_blocks",
    "relative_distance",
    "round_event",
    "round_multiplier",
    "sample_dn",
    "sample_dn_star",
    "satisfies_eq23",
    "secret_factor",
    "sigmas_for_theta",
    "theta_after",
    "split_blocks",
    "theta_complete",
    "theta_for_noise_multiplier",
    "theta_n_out",
    "torch_threads",
    "unflatten",
]
