"""Differential privacy: DP-SGD (local, record-level) and DP-FedAvg (central, client-level),
each with its accounting, and the disclosure rule for what clients send in the clear."""
