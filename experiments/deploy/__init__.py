"""`fedpriv deploy`: the same apps on a real SuperLink and SuperNodes across hosts (TLS, keys)."""
