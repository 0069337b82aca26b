"""The tiny decoder of the underflow tests (tests/test_underflow.py, tests/dist/underflow_cases.py):
token embedding, ``layers`` pre-norm MLP blocks (RMSNorm ``ln``, ``up``, GELU, ``down``), a final
RMSNorm ``norm`` and an untied ``lm_head`` (both run in at least float32, autocast off);
``forward(ids, labels)`` returns the mean cross-entropy times ``loss_weight``. Initialised like a
LLaMA (normal, std 0.02). The small
``loss_weight`` stands in for the per-element gradient magnitudes of a large model (a mean over
many tokens, a long accumulation): under fp16 autocast without loss scaling most of the decoder
layers' weight-gradient elements flush to exact zeros, while unused embedding rows are zero in any
precision."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.up, self.down = RMSNorm(d), nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, loss_weight: float = 1e-3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)
        self.loss_weight = loss_weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for blk in self.layers:
            x = blk(x)
        dt = torch.promote_types(self.lm_head.weight.dtype, torch.float32)  # fp16 weights (DeepSpeed fp16): fp32
        with torch.autocast(x.device.type, enabled=False):  # the output head in float32 (as many LLM codes)
            logits = F.linear(self.norm(x.to(dt)), self.lm_head.weight.to(dt))
        return self.loss_weight * F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def clone(model: Decoder) -> Decoder:
    """A fresh decoder with ``model``'s weights and dtype (no hook or attribute an engine or
    distgrad put on ``model``)."""
    new = Decoder(len(model.embed.weight), model.embed.weight.shape[1], len(model.layers),
                  loss_weight=model.loss_weight).to(next(model.parameters()).dtype)
    new.load_state_dict(model.state_dict())
    return new


class TrainingPassSpy:
    """What the underflow check of the framework integrations compares (tests/test_integrations_hf.py,
    tests/test_integrations_lightning.py): per trainable parameter of ``model`` (by name), the
    gradient the *training* backward produced for the first micro-batch of the run (a tensor hook
    on each parameter keeps the first gradient it sees: the micro-batch's own, before it is
    accumulated into ``.grad``), and the gradient of the underflow signal's training-precision pass
    (:meth:`distgrad.signals.underflow.Underflow._pass` wrapped through ``monkeypatch``; its
    reference pass is not kept). Use as a context manager around the training run."""

    def __init__(self, model: nn.Module, monkeypatch) -> None:
        from distgrad.signals.underflow import Underflow

        self.training: dict[str, torch.Tensor] = {}
        self.replayed: dict[str, torch.Tensor | None] = {}
        self._handles = []
        for n, p in model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._keep(n)))
        orig = Underflow._pass
        spy = self

        def _pass(self_, k, reference, scale, full=None):
            grads = orig(self_, k, reference, scale, full)
            if not reference and not spy.replayed:
                spy.replayed = {n: (None if g is None else g.detach().clone())
                                for (n, _), g in zip(self_.params, grads)}
            return grads

        monkeypatch.setattr(Underflow, "_pass", _pass)

    def _keep(self, name: str):
        def hook(g: torch.Tensor) -> None:
            self.training.setdefault(name, g.detach().clone())
        return hook

    def __enter__(self) -> TrainingPassSpy:
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def mismatches(self, strip: str = "") -> list[str]:
        """Parameter names whose replayed gradient is not equal, element for element, to the
        training one (``strip``: a prefix of the signal's names, e.g. a wrapper's ``"net."``
        ... removed before matching); every trainable parameter must be in both."""
        assert self.replayed, "the underflow signal did not recompute"
        replayed = {n[len(strip):] if n.startswith(strip) else n: g for n, g in self.replayed.items()}
        assert set(replayed) == set(self.training), (sorted(replayed)[:3], sorted(self.training)[:3])
        return [n for n, g in self.training.items()
                if replayed[n] is None or not torch.equal(replayed[n], g)]
