"""Parameter name -> layer label (:func:`layer_of`), the order of layer labels and
:class:`LayerIndex`, the cached name -> layer-column mapping of the report and the TensorBoard sink."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from distgrad.naming.grouping import group_sums
from distgrad.record import ParamStats

_INT_RE = re.compile(r"[./]")


def _load_classify() -> Callable[[str], Any] | None:
    try:
        from distgrad.naming.classify import classify
    except Exception:  # not written yet, or broken: fall back
        return None
    return classify


def layer_of(name: str, classify: Callable[[str], Any] | None = None) -> str:
    """Layer label of parameter ``name``.

    Uses ``distgrad.naming.classify.classify(name).layer`` when that module is importable (pass
    ``classify`` to avoid the import look-up); otherwise -- or when it fails or returns no
    layer -- the first all-digit component of the dotted/slashed path
    (``"model.layers.12.mlp.w"`` -> ``"12"``), else ``"other"``. Always a ``str``.
    """
    if classify is None:
        classify = _load_classify()
    if classify is not None:
        try:
            layer = classify(name).layer
        except Exception:
            layer = None
        if layer is not None and layer != "":
            return str(layer)
    for part in _INT_RE.split(name):
        if part.isdigit():
            return str(int(part))
    return "other"


_SPECIAL_ORDER = {"embed": 0, "norm": 3, "final_norm": 3, "head": 4, "other": 6}
_BLOCK_LABEL_RE = re.compile(r"(?:(enc|dec)\.)?(\d+)")


def layer_sort_key(layer: str) -> tuple[int, int, int, str]:
    """Sort key for layer labels: ``embed``, blocks by number (``enc.N`` before ``dec.N``),
    ``norm``, ``head``, any other label alphabetically, ``other`` last."""
    m = _BLOCK_LABEL_RE.fullmatch(layer)
    if m:
        return (1 if m.group(1) != "dec" else 2, {"enc": 0, None: 1}.get(m.group(1), 2), int(m.group(2)), "")
    if layer in _SPECIAL_ORDER:
        return (_SPECIAL_ORDER[layer], 0, 0, layer)
    return (5, 0, 0, layer)


class LayerIndex:
    """Stable mapping of parameter names to layer columns, cached per distinct names list.

    ``layers`` lists every layer label seen so far, in first-seen order (column order);
    :meth:`map` gives the column of each name. Looking the same names list up again costs one
    tuple hash. At most 64 distinct names lists are cached (the cache is reset beyond).
    """

    def __init__(self, classify: Callable[[str], Any] | None = None) -> None:
        self._classify = classify if classify is not None else _load_classify()
        self.layers: list[str] = []
        self._col: dict[str, int] = {}
        self._cache: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}

    def _lookup(self, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        key = tuple(names)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= 64:
                self._cache.clear()
            cols = []
            for n in key:
                layer = layer_of(n, self._classify) if self._classify else layer_of(n, _no_classify)
                c = self._col.get(layer)
                if c is None:
                    c = self._col[layer] = len(self.layers)
                    self.layers.append(layer)
                cols.append(c)
            idx = np.asarray(cols, dtype=np.int64)
            hit = self._cache[key] = (idx, np.unique(idx))
        return hit

    def map(self, names: Sequence[str]) -> np.ndarray:
        """int64 array ``[len(names)]``: the layer column of each parameter."""
        return self._lookup(names)[0]

    def norms_and_nonfinite(self, stats: ParamStats) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer gradient L2 norm (``sqrt`` of the members' summed ``sumsq``, as
        ``grouping.aggregate(...).norm``) and NaN + Inf element count, float64 arrays ``[L]`` over
        every layer seen so far; 0 for layers none of ``stats``' parameters belong to (see
        :meth:`present`). Sums by :func:`distgrad.naming.grouping.group_sums`."""
        idx, L = self.map(stats.names), len(self.layers)
        with np.errstate(invalid="ignore"):
            return np.sqrt(group_sums(idx, stats.sumsq, L)), group_sums(idx, stats.nonfinite, L)

    def present(self, names: Sequence[str]) -> np.ndarray:
        """Sorted int64 array of the layer columns that ``names`` populate."""
        return self._lookup(names)[1]


class _NoClassify:
    layer = None


def _no_classify(name: str) -> _NoClassify:
    return _NoClassify()
