"""Attacks on what a server observes of a client's update, in plain PyTorch (no Flower).

They take what an honest-but-curious server holds — the weights it sent, the weights
that came back, the round's training configuration, what the client disclosed
(:class:`.observation.Observation`) — and return reconstructions or scores; the
scoring against the client's real data happens elsewhere
(:mod:`privacy.analysis.leakage_metrics`), with ground truth the attacks never see.

- :mod:`.inversion`: Inverting Gradients (Geiping et al. 2020) and DLG (Zhu et al. 2019)
- :mod:`.labels`: labels from the last layer (iDLG; counts for larger batches)
- :mod:`.membership`: loss-threshold, loss-drop and gradient-alignment membership inference
- :mod:`.audit`: one-run DP auditing with canaries (Steinke et al. 2023)
"""

# The attacks a run can ask for (run-config key `attacks`), with what each needs.
ATTACKS = {
    "labels": "which labels the client trained on (iDLG / counts from the last layer)",
    "invert": "reconstruct its training inputs (Inverting Gradients)",
    "dlg": "reconstruct them with DLG (L2 matching, L-BFGS), the classic baseline",
    "mia": "membership inference against its update and the released global model",
    "audit": "one-run DP audit with canaries (needs canaries > 0)",
}
