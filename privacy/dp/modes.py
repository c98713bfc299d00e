"""The named options of fedpriv's DP mechanisms (light: importing this loads no torch)."""

# How Opacus computes per-sample gradient norms (privacy.dp.dpsgd); "auto" picks per model.
GRAD_SAMPLE_MODES = ("auto", "hooks", "ghost", "bookkeeping")
# How DP-FedAvg picks each round's clients (privacy.dp.dpfedavg): a fixed-size cohort,
# Poisson, or cyclic groups (each client once every cyclic-groups rounds; cyclic-poisson
# samples within the round's group).
CLIENT_SAMPLINGS = ("fixed", "poisson", "cyclic", "cyclic-poisson")
# The noise of central DP across rounds (privacy.dp.correlated): independent per round
# (DP-FedAvg), banded matrix factorization, DP-FTRL's tree, buffered linear Toeplitz.
CENTRAL_MECHANISMS = ("gaussian", "banded-mf", "tree", "blt")
# Where DP-FedAvg clips client updates, and whether the norm adapts (Andrew et al. 2021).
CENTRAL_CLIPPINGS = ("server-fixed", "client-fixed", "server-adaptive", "client-adaptive")
