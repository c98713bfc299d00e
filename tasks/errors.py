"""The one error a user can cause by what they ask for."""


class ConfigError(ValueError):
    """An unusable run config; the message says what is wrong, what is allowed, how to fix it."""
