"""Per-token loss distribution: a fixed-bin histogram of token losses, the fraction of tokens
above a threshold, and perplexity, per data source when the loop labels its sequences; merged
across ranks in the sampled step's existing SUM and MAX collectives.

Input (``Instrument.observe_loss(loss, token_losses=..., ...)``, one micro-batch): per-token
losses in nats (``[B, T]`` or ``[N]``, any float dtype, any device; e.g.
``F.cross_entropy(..., reduction="none")``), an optional mask of the tokens that count (padding
and ignored labels out), and optional per-sequence source labels (``B`` strings from the
configured ``loss.sources``; a label not in it, or None, counts as ``"other"``). Or logits and
labels: the per-token cross-entropy is computed in row chunks of at most :data:`CHUNK_ELEMENTS`
float32 logits (never a copy of the whole logits), labels equal to ``ignore_index`` left out.

What is kept between micro-batches is the histogram block only, a float64
``[S + 1, len(TOKEN_COLS)]`` tensor on the device (S configured sources, plus ``"other"``):
token count, sum of token losses, tokens above the threshold, NaN tokens, then one count per
bin. Transient work per micro-batch is of the size of the token losses (a float64 copy and the
bin indices). No host synchronisation, no collective: the block rides in the step's SUM
collective and the largest token loss in the MAX collective.

Bins (nats): bin ``i`` holds ``EDGES[i-1] < x <= EDGES[i]`` (Prometheus' ``le``), the first
``x <= EDGES[0]``, the last ``x > EDGES[-1]`` (+Inf included); NaN tokens are counted apart and
make the sum NaN. Perplexity is ``exp(sum / tokens)`` over every counted token of the step on
all ranks (the token-weighted mean, as a language model's perplexity is defined).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: upper edges of the fixed token-loss bins, in nats (a last bin holds everything above)
EDGES = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0)
#: columns of the per-source block, then one count per bin
TOKEN_COLS = ("tokens", "loss_sum", "above", "nan") + tuple(f"bin{i}" for i in range(len(EDGES) + 1))
#: logits read per chunk by the logits path (elements)
CHUNK_ELEMENTS = 1 << 22
OTHER = "other"


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without waiting for the device: on CUDA
    through pinned memory and a non-blocking copy (the caching host allocator keeps the pinned
    buffer until the copy has run); elsewhere the host tensor itself."""
    t = torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class TokenLossError(ValueError):
    """observe_loss got token inputs it cannot use (message: what and the fix)."""


@dataclasses.dataclass
class TokenBlock:
    """Reduced per-token statistics of one step (host, float64)."""

    sources: list[str]  #: configured sources then "other"
    rows: np.ndarray  #: [S + 1, len(TOKEN_COLS)]
    max_token_loss: float


class TokenLoss:
    """Accumulates one rank's token-loss histogram between two optimizer-step boundaries.

    Args:
        sources: the configured data-source labels (bounded; may be empty).
        threshold: tokens with a loss above it (nats) are counted in ``above``.
    """

    def __init__(self, sources: Sequence[str], threshold: float) -> None:
        self.sources = list(sources) + [OTHER]
        self.index = {s: i for i, s in enumerate(sources)}
        self.threshold = float(threshold)
        self._edges: dict[torch.device, torch.Tensor] = {}
        self.block: torch.Tensor | None = None  # [S + 1, len(TOKEN_COLS)] float64
        self.max: torch.Tensor | None = None  # 0-d float64

    @property
    def sum_size(self) -> int:
        return len(self.sources) * len(TOKEN_COLS)

    max_size = 1

    def _edges_on(self, device: torch.device) -> torch.Tensor:
        e = self._edges.get(device)
        if e is None:
            e = self._edges[device] = torch.tensor(EDGES, dtype=torch.float64, device=device)
        return e

    @staticmethod
    def from_logits(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cross-entropy ``[...]`` (float32, labels' shape) and the mask of counted
        tokens from ``logits`` ``[..., V]`` and ``labels`` ``[...]`` (aligned as the loss is:
        shift them as the loss does), in row chunks of at most :data:`CHUNK_ELEMENTS` logits.

        Raises:
            TokenLossError: shapes that do not match."""
        if logits.dim() < 2 or tuple(logits.shape[:-1]) != tuple(labels.shape):
            raise TokenLossError(f"logits of shape {list(logits.shape)} and labels of shape {list(labels.shape)}: "
                                 "pass logits [..., vocab] and labels [...] aligned as your loss uses them")
        v = logits.shape[-1]
        flat, lab = logits.detach().reshape(-1, v), labels.detach().reshape(-1).to(logits.device)
        rows = max(1, CHUNK_ELEMENTS // max(v, 1))
        out = torch.empty(lab.shape, dtype=torch.float32, device=logits.device)
        for i in range(0, flat.shape[0], rows):
            out[i:i + rows] = F.cross_entropy(flat[i:i + rows].float(), lab[i:i + rows], reduction="none",
                                              ignore_index=ignore_index)
        return out.reshape(labels.shape), labels.to(logits.device) != ignore_index

    def add(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, sources: Sequence[Any] | None = None) -> None:
        """Add one micro-batch's per-token losses (see the module docstring). Device work only.

        Raises:
            TokenLossError: a mask of another shape, sources without ``[B, T]`` token losses or
                of another length than ``B``."""
        t = tokens.detach()
        if mask is not None and tuple(mask.shape) != tuple(t.shape):
            raise TokenLossError(f"token_mask of shape {list(mask.shape)} for token losses of shape {list(t.shape)}: "
                                 "pass a boolean mask of the same shape (True for tokens that count)")
        if sources is not None and (t.dim() != 2 or len(sources) != t.shape[0]):
            raise TokenLossError(f"{len(sources)} source labels for token losses of shape {list(t.shape)}: pass "
                                 "token losses [batch, tokens] and one label per sequence")
        dev = t.device
        x = t.to(torch.float64).reshape(-1)
        n, S, nb = x.numel(), len(self.sources), len(EDGES) + 1
        if sources is not None:
            src = to_device([self.index.get(s, S - 1) for s in sources], torch.long, dev)
            src = src.repeat_interleave(int(t.shape[1]))
        else:
            src = torch.full((n,), S - 1, dtype=torch.long, device=dev)
        keep = (torch.ones(n, dtype=torch.bool, device=dev) if mask is None
                else mask.detach().reshape(-1).to(device=dev, dtype=torch.bool))
        nan = torch.isnan(x)
        # no boolean indexing and no torch.bincount (both wait for the device on CUDA): tokens
        # left out go to a trash slot of index_add_
        slot = torch.where(keep, src, torch.full_like(src, S))
        bins = torch.bucketize(torch.where(nan, torch.zeros_like(x), x), self._edges_on(dev), right=False)
        flat = torch.where(keep & ~nan, src * nb + bins, torch.full_like(bins, S * nb))
        one = torch.ones(n, dtype=torch.float64, device=dev)
        block = torch.zeros((S + 1, len(TOKEN_COLS)), dtype=torch.float64, device=dev)
        block[:, 0].index_add_(0, slot, one)
        block[:, 1].index_add_(0, slot, torch.where(keep, x, torch.zeros_like(x)))
        block[:, 2].index_add_(0, slot, ((x > self.threshold) & keep).to(torch.float64))
        block[:, 3].index_add_(0, slot, (nan & keep).to(torch.float64))
        hist = torch.zeros(S * nb + 1, dtype=torch.float64, device=dev).index_add_(0, flat, one)
        block[:S, 4:] = hist[: S * nb].view(S, nb)
        block = block[:S]
        mx = (torch.where(keep, x, torch.full_like(x, -math.inf)).max() if n
              else torch.full((), -math.inf, dtype=torch.float64, device=dev))
        if self.block is None or self.max is None:  # both None or both set
            self.block, self.max = block, mx
        else:
            self.block = self.block + block.to(self.block.device)
            self.max = torch.maximum(self.max, mx.to(self.max.device))

    def take(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's ``(sum_part [sum_size], max_part [1])`` for the collectives, then start
        over (zeros and -inf when nothing was added)."""
        if self.block is None or self.max is None:  # both None or both set
            s = torch.zeros(self.sum_size, dtype=torch.float64, device=device)
            m = torch.full((1,), -math.inf, dtype=torch.float64, device=device)
        else:
            s, m = self.block.reshape(-1).to(device), self.max.reshape(1).to(device)
        self.block, self.max = None, None
        return s, m

    def clear(self) -> None:
        """Drop what was added this step."""
        self.block, self.max = None, None

    def unpack(self, s: np.ndarray, m: np.ndarray) -> TokenBlock | None:
        """The reduced block, or None when no rank counted a token this step."""
        rows = np.asarray(s, dtype=np.float64).reshape(len(self.sources), len(TOKEN_COLS))
        if rows[:, 0].sum() <= 0:
            return None
        return TokenBlock(list(self.sources), rows, float(m[0]))


def summarize(b: TokenBlock, threshold: float) -> dict[str, Any]:
    """The exported figures of a reduced block: ``tokens``, ``mean`` (nats), ``perplexity``,
    ``above_fraction``, ``hist`` (counts per bin), ``max``, and per source (those with tokens)
    the same minus the histogram."""
    def one(r: np.ndarray) -> dict[str, Any]:
        n = float(r[0])
        mean = float(r[1] / n) if n else float("nan")
        with np.errstate(over="ignore"):
            ppl = float(np.exp(mean)) if n else float("nan")
        return {"tokens": n, "mean": mean, "perplexity": ppl, "above_fraction": float(r[2] / n) if n else float("nan"),
                "nan_tokens": float(r[3])}
    tot = b.rows.sum(axis=0)
    out = one(tot)
    out.update(threshold=threshold, edges=list(EDGES), hist=tot[4:].tolist(), max=b.max_token_loss,
               sources={s: {**one(r), "hist": r[4:].tolist()} for s, r in zip(b.sources, b.rows) if r[0] > 0})
    return out
