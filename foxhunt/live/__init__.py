"""Trading an export live, bar by bar, with the back-test's own decisions: ``session = foxhunt.live.open(export)``,
``decision = session.on_bar(symbols, ohlcv, timestamp)``; ``python -m foxhunt.live`` replays a file or reads stdin."""

from foxhunt.live.session import Decision, LiveSession, open

__all__ = ["Decision", "LiveSession", "open"]
