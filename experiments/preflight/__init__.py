"""Pre-flight checks: the data, model and privacy settings checked before any process starts."""
