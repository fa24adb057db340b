"""User-facing errors: reported as one line, non-zero exit, no traceback."""


class UserError(Exception):
    """A problem with the user's input (config value, path, file). The message names the key or file."""


class ConfigError(UserError):
    """A configuration value is invalid; the message names the key."""


class NonFiniteError(UserError):
    """A model produced NaN or infinite values where a decode needs finite ones."""


def check_finite_logits(logits) -> None:
    """Stop a decode whose model produced unusable logits: any NaN or +inf, or a position whose logits are all
    -inf (a single -inf column is normal: suppressed tokens). Meant for the first forward of a decode: one
    reduction and one host-device sync, a second only to describe a failure. Needs no torch import here."""
    nan = logits.isnan().any()
    pinf = logits.isposinf().any()
    dead = logits.isneginf().all(dim=-1).any()
    if not bool(nan | pinf | dead):
        return
    n_nan, n_pinf = int(logits.isnan().sum()), int(logits.isposinf().sum())
    n_dead = int(logits.isneginf().all(dim=-1).sum())
    parts = [f"{n} {what}" for n, what in ((n_nan, "NaN"), (n_pinf, "+inf"), (n_dead, "positions with only -inf"))
             if n]
    raise NonFiniteError(f"the model produced non-finite logits at the first forward ({', '.join(parts)} of "
                         f"{logits.numel()} values): check the weights and the dtype (float16 overflow?)")
