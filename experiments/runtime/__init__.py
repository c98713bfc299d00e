"""Processes fedpriv owns on this machine: a private SuperLink, its keeper, a run start to end."""
