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


def make(seed: int = 0, fsdp_float8_all_gather: bool = False) -> Fp8Model:
    """The model with its block linears converted by torchao (emulated float8 matmuls);
    ``fsdp_float8_all_gather``: torchao's ``enable_fsdp_float8_all_gather`` (the weights become
    ``WeightWithDynamicFloat8CastTensor``; FSDP2 then all-gathers them in float8)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    m = Fp8Model()
    cfg = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    convert_to_float8_training(m, config=cfg,
                               module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."))
    return m


def capture(model: nn.Module, weights: bool = True) -> tuple[dict, list]:
    """Record, another way than the signal's hooks, every tensor each float8 layer casts: a
    forward hook (its input and, with ``weights``, its weight) and a full backward hook (its
    grad_output), as copies, into ``caps[(module name, tensor)]`` lists; returns
    ``(caps, handles)``."""
    from torchao.float8.float8_linear import Float8Linear

    caps: dict = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear):
            def fwd(mod, args, out, name=name):
                if torch.is_grad_enabled():
                    caps.setdefault((name, "input"), []).append(args[0].detach().clone())
                    if weights:
                        caps.setdefault((name, "weight"), []).append(mod.weight.detach().clone())

            def bwd(mod, gin, gout, name=name):
                caps.setdefault((name, "grad_output"), []).append(gout[0].detach().clone())
            handles += [m.register_forward_hook(fwd), m.register_full_backward_hook(bwd)]
    return caps, handles


def reference(xs: list[torch.Tensor], dtype: torch.dtype, amax_of_scale: float | None = None) -> dict[str, float]:
    """The float64 reference of the casts of ``xs`` (one tensor per micro-batch) to ``dtype``
    with torchao's dynamic tensorwise scale written out from its definition
    (``scale = float32(fp8_max / max(amax, 1e-12))``, amax in float64; ``amax_of_scale``: the
    amax the scale was computed from when it is not the tensor's own, a stale precomputed
    scale), the scaled values are
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
        src = amax if amax_of_scale is None else amax_of_scale
        scale = torch.tensor(fi.max / max(src, 1e-12), dtype=torch.float64).float()
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


def cast_references(caps: dict, handles: list) -> dict[str, list[dict[str, float]]]:
    """Remove :func:`capture`'s hooks (``handles``) and return the float64 :func:`reference` of
    each tensor it captured in ``caps`` (one per cast, in capture order: per micro-batch), keyed
    ``"module name|tensor"`` (a JSON key), each with torchao's dtype of that tensor (DTYPES)."""
    for h in handles:
        h.remove()
    return {f"{name}|{role}": [reference([x], DTYPES[role]) for x in xs] for (name, role), xs in caps.items()}


_FSDP_CASES: dict = {}


def fsdp_cases() -> dict:
    """The results of one launch of tests/dist/fp8_fsdp_cases.py (2 gloo ranks: the float8
    all-gather run with a stale precomputed scale and its healthy twin), made once per test
    session and shared by tests/test_fp8.py (exactness) and
    tests/monitoring/test_precursor_paging.py (the replay of its JSONL logs)."""
    if not _FSDP_CASES:
        import tempfile
        from pathlib import Path

        from tests.helpers import launch

        _FSDP_CASES.update(launch("fp8_fsdp_cases.py", Path(tempfile.mkdtemp(prefix="dg_fp8_fsdp_")) / "out.json"))
    return _FSDP_CASES
