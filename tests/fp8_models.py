"""A tiny float8 model for the FP8 scaling-health tests (tests/test_fp8.py,
tests/dist/logits_cases.py): two blocks of two torchao ``Float8Linear`` (emulated on the CPU)
and a plain output head, and the float64 reference of one float8 cast."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

D, H, C = 16, 32, 5
#: torchao's default float8 dtypes per cast tensor (Float8LinearConfig's tensorwise recipe)
DTYPES = {"input": torch.float8_e4m3fn, "weight": torch.float8_e4m3fn, "grad_output": torch.float8_e5m2}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Fp8Model(nn.Module):
    """Input ``[B, D]`` float32 -> class logits ``[B, C]``; ``blocks.{0,1}.{up,down}`` are
    float8 layers after :func:`make`."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make(seed: int = 0) -> Fp8Model:
    """The model with its block linears converted by torchao (emulated float8 matmuls)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    m = Fp8Model()
    convert_to_float8_training(m, config=Float8LinearConfig(emulate=True),
                               module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."))
    return m


def capture(model: nn.Module) -> tuple[dict, list]:
    """Record, another way than the signal's hooks, every tensor each float8 layer casts: a
    forward hook (its input and weight) and a full backward hook (its grad_output), as float64
    copies, into ``caps[(module name, tensor)]`` lists; returns ``(caps, handles)``."""
    from torchao.float8.float8_linear import Float8Linear

    caps: dict = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear):
            def fwd(mod, args, out, name=name):
                if torch.is_grad_enabled():
                    caps.setdefault((name, "input"), []).append(args[0].detach().clone())
                    caps.setdefault((name, "weight"), []).append(mod.weight.detach().clone())

            def bwd(mod, gin, gout, name=name):
                caps.setdefault((name, "grad_output"), []).append(gout[0].detach().clone())
            handles += [m.register_forward_hook(fwd), m.register_full_backward_hook(bwd)]
    return caps, handles


def reference(xs: list[torch.Tensor], dtype: torch.dtype) -> dict[str, float]:
    """The float64 reference of the casts of ``xs`` (one tensor per micro-batch) to ``dtype``
    with torchao's dynamic tensorwise scale written out from its definition
    (``scale = float32(fp8_max / max(amax, 1e-12))``, amax in float64): the scaled values are
    cast by torch (a saturating cast) and compared with the float64 values: underflow = nonzero
    in float64 and 0 after the cast; saturated = the cast off by more than half the last step
    below fp8_max."""
    fi = torch.finfo(dtype)
    top = 2.0 ** math.floor(math.log2(fi.max)) * fi.eps
    out = dict(amax_min=math.inf, amax_max=-math.inf, scale_min=math.inf, scale_max=-math.inf,
               elements=0, underflow=0, saturated=0)
    for x in xs:
        x64 = x.double()
        amax = x64.abs().max().item()
        scale = torch.tensor(fi.max / max(amax, 1e-12), dtype=torch.float64).float()
        y32 = x.float() * scale
        c = y32.to(dtype).double()
        y64 = x64 * scale.double()
        out["amax_min"], out["amax_max"] = min(out["amax_min"], amax), max(out["amax_max"], amax)
        out["scale_min"] = min(out["scale_min"], scale.item())
        out["scale_max"] = max(out["scale_max"], scale.item())
        out["elements"] += x.numel()
        out["underflow"] += int(((x64 != 0) & (c == 0)).sum())
        out["saturated"] += int(((y64.abs() - c.abs()) > top / 2).sum())
    return out
