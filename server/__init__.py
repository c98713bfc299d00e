"""The ServerApp: strategy, rounds, central evaluation, and the per-round ledger of a run."""
