"""The package version, in one place (the package, exports and their loader read it)."""

__version__ = "0.1.0"
