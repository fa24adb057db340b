"""User-facing errors: reported as one line, non-zero exit, no traceback."""


class UserError(Exception):
    """A problem with the user's input (config value, path, file). The message names the key or file."""


class ConfigError(UserError):
    """A configuration value is invalid; the message names the key."""
