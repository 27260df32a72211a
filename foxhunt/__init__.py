"""foxhunt: a Lightning ensemble of a Temporal Fusion Transformer and a Double DQN that trades OHLCV bars."""

__version__ = "0.1.0"


def load(path: str, map_location: str = "cpu"):
    """Rebuild an exported ensemble from its safetensors and metadata (see :mod:`foxhunt.export`)."""
    from foxhunt.export import load as _load

    return _load(path, map_location=map_location)
