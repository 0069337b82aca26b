"""Imports the built-in packed signals so that their factories are registered (in this order,
which is their order in the packed tensors)."""

from __future__ import annotations

from distgrad.signals import histogram  # noqa: F401,E402
from distgrad.signals import adam  # noqa: F401,E402 - optimizer-aware signals (Adam family)
from distgrad.signals import noise_scale  # noqa: F401,E402 - gradient noise scale
from distgrad.signals import curvature  # noqa: F401,E402 - curvature along the last update
