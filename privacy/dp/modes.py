"""The named options of fedpriv's DP mechanisms (light: importing this loads no torch)."""

# How Opacus computes per-sample gradient norms (privacy.dp.dpsgd); "auto" picks per model.
GRAD_SAMPLE_MODES = ("auto", "hooks", "ghost", "bookkeeping")
# How DP-FedAvg picks each round's clients (privacy.dp.dpfedavg).
CLIENT_SAMPLINGS = ("fixed", "poisson")
# Where DP-FedAvg clips client updates, and whether the norm adapts (Andrew et al. 2021).
CENTRAL_CLIPPINGS = ("server-fixed", "client-fixed", "server-adaptive", "client-adaptive")
