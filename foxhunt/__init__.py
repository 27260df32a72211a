"""foxhunt: a Lightning ensemble of a Temporal Fusion Transformer and a Double DQN that trades OHLCV bars."""

__version__ = "0.1.0"
