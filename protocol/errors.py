"""Exception families for errors a user or a remote peer can cause.

One type per family so callers can catch exactly what they can recover from, and so messages can say
what to fix. None of these is raised after state has been partially modified.
"""


class HeteroNodeError(Exception):
    """Base class of every error hetero-node raises on purpose."""


class ConfigError(HeteroNodeError):
    """A run or node configuration is invalid, or does not match the swarm's."""


def require_positive(config: object, *fields: str) -> None:
    """Raise one ConfigError naming every listed field (as its CLI option) that is not positive."""
    bad = [f"--{name.replace('_', '-')} must be positive, got {getattr(config, name)}" for name in fields
           if not getattr(config, name) > 0]  # fmt: skip
    if bad:
        raise ConfigError("; ".join(bad))


def positive_int_list(text: str, flag: str) -> list[int]:
    """A comma-separated option of positive integers ("8,16,32"), or a ConfigError naming the option."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r}: comma-separated positive integers")
    return values


def require_ports(config: object, *fields: str) -> None:
    """Raise one ConfigError naming every listed field that is set (not None) and not a TCP port number."""
    bad = [f"--{name.replace('_', '-')} must be in 0..65535, got {getattr(config, name)}" for name in fields
           if getattr(config, name) is not None and not 0 <= getattr(config, name) < 65536]  # fmt: skip
    if bad:
        raise ConfigError("; ".join(bad))


class DataError(HeteroNodeError):
    """A corpus, token cache or tokenizer file is missing, corrupt or unreadable (the message names the file)."""


class PayloadError(HeteroNodeError):
    """A message from a peer is malformed: wrong size, wrong layout, or non-finite values."""


class CheckpointError(HeteroNodeError):
    """A checkpoint is missing, corrupt, or belongs to a different run."""


class PeerAddressError(HeteroNodeError):
    """A peer multiaddr is malformed or the peers behind it cannot be reached."""


class DaemonError(HeteroNodeError):
    """This node's own p2p daemon died: it cannot reach the swarm until it is restarted."""
