"""The ClientApp: partition loading, local training (plain SGD, and later DP-SGD), metrics."""
