"""Privacy: DP accounting and mechanisms, anonymizers, privacy metrics, leakage attacks.

Nothing here imports Flower app code, so every piece can be used on saved updates.
"""
