"""Imports the built-in packed signals so that their factories are registered (in this order,
which is their order in the packed tensors), and :func:`build`, which instantiates them."""

from __future__ import annotations

from typing import Any

from distgrad.signals import (
    FACTORIES,
    SignalPack,
    adam,  # noqa: F401,E402 - optimizer-aware signals (Adam family)
    curvature,  # noqa: F401,E402 - curvature along the last update
    duplicate_data,  # noqa: F401,E402 - ranks training on the same data
    fp8,  # noqa: F401,E402 - float8 scaling health (torchao)
    histogram,  # noqa: F401,E402
    logits,  # noqa: F401,E402 - attention and output logit precursors
    noise_scale,  # noqa: F401,E402 - gradient noise scale
    router,  # noqa: F401,E402 - MoE router health
    underflow,  # noqa: F401,E402 - lost to underflow vs genuinely zero (recomputation)
    update,  # noqa: F401,E402 - applied-update geometry for any optimizer
    weight_hash,  # noqa: F401,E402 - replica weight hashes
)


def build(inst: Any) -> SignalPack:
    """Call every registered factory (the built-in signals are registered by this module's
    imports); raises what a factory raises (a configuration error at ``instrument()`` time).
    Here rather than in :mod:`distgrad.signals`, which the signals import for the registry."""
    signals = []
    for _name, factory in FACTORIES:
        sig = factory(inst)
        if sig is not None:
            signals.append(sig)
    return SignalPack(signals)
