"""What several method cards share: the record-level regime and the wording of each adversary."""

from __future__ import annotations

from protocols.methods.spec import FULL_BATCH

#: ``model-ema`` of the record-step regimes: publish an average of the global models (post-processing, no privacy
#: cost); the DP noise adds up in the last model like a random walk while the signal saturates early.
MODEL_EMA = 0.8
#: The record-level step of NADP-FL that every full-batch method shares: one full-batch step of per-example-clipped
#: gradients per round, so a record moves a client's model by at most Lemma 1's 2 C lr / n_k.  ``input-centering``
#: (each image minus its own mean pixel, a per-record transform) speeds up a few noisy full-batch steps.
RECORD_STEP = {"small": {"hidden": "", "local-epochs": 1, "batch-size": FULL_BATCH, "lr": 4.0, "clip": 1.0,
                         "num-rounds": 30, "model-ema": MODEL_EMA, "input-centering": True},
               "large": {"num-rounds": 60}}

#: ``MethodSpec.fixed`` of the methods whose clients compute one gradient per round over all their records (FedSGD):
#: they read neither key, and train as one epoch in one full batch.
FULL_BATCH_GRADIENT = {"local-epochs": 1, "batch-size": FULL_BATCH}

#: The round-time goals of most cards (``MethodSpec.round_time_goal``): a round within 1.1x FedAvg's in-process
#: and under simulation, within 1.2x in deployment (each extra message phase is one more round trip).
ROUND_GOALS = {"round_time_goal": 1.1, "deployment_round_time_goal": 1.2}

SERVER = "the server and eavesdroppers (honest-but-curious server)"
MODEL = "anyone who gets the published global models"
MODEL_TRUSTED = "anyone who gets the published global models (the server is trusted with the uploads)"
#: The MP family's model epsilon holds given the server's secret R: the clients' clip bounds a record's R-divided step
#: g^ - r^T Psi + v Phi by kappa clip and the server's Gaussian covers kappa (protocols.mpddp.calibration).
MODEL_GIVEN_R = ("anyone who gets the published global models, the server's secret R included (the honest-but-curious "
                 "server adds the Gaussian the model's claim rests on)")
