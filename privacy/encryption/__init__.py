"""Encrypted aggregation: CKKS homomorphic encryption of updates and the key exchange."""
