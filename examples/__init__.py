"""Worked examples of extending fedpriv with plugins (see README.md here and docs/EXTENDING.md)."""
