"""The ClientApp: handlers by action, its mods, one local update (SGD, FedProx, DP-SGD),
the update steps after training, anonymized releases and the client's side of HE."""
