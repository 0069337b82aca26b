"""The package version, in a module of its own so that nothing imports :mod:`distgrad` (and with
it the whole instrument) for it."""

__version__ = "0.1.0"
