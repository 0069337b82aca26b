"""Multi-rank test drivers, each run as ``torchrun -m tests.dist.<name>`` by
:func:`tests.helpers.launch` (every case of a driver in one launch: start-up is slow), and what
they share: :mod:`tests.dist.common` (model, data, float64 references) and
:mod:`tests.dist.engines` (one builder per engine)."""
