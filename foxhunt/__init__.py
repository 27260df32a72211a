"""foxhunt: a Lightning ensemble of forecasters (TFT) and agents (Double DQN) that trades OHLCV bars."""

from foxhunt.version import __version__

__all__ = ["__version__", "load"]


def load(path: str, map_location: str = "cpu"):
    """Rebuild an exported ensemble from its safetensors and metadata (see :mod:`foxhunt.export`)."""
    from foxhunt.export.load import load as _load

    return _load(path, map_location=map_location)
