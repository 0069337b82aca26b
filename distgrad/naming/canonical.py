"""Parameter names as the user wrote them: the one function that removes what wrappers add
(:func:`clean_name`, used by every engine adapter and by :mod:`distgrad.naming.classify`), and the
canonical name that classification works on (:func:`canonical_name`: PEFT parts removed too).
"""

from __future__ import annotations

import re

#: path components that wrappers insert into parameter names: FSDP1, activation checkpointing,
#: ``torch.compile`` and Lightning's ``_forward_module``
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod",
                                "_forward_module"})


def clean_name(name: str, *, strip_module: bool = True, peft_root: bool = False) -> str:
    """A parameter name without the components wrappers add.

    Args:
        name: dotted name from ``named_parameters()`` of a (possibly wrapped) module.
        strip_module: also remove leading ``module.`` components (DDP / DeepSpeed wrap the
            user's model as ``module``; repeated, never the last component). The PyTorch
            adapters pass False: they start from the user's own module, where ``module`` is a
            real name.
        peft_root: also remove a leading ``base_model.model.`` (PEFT's ``PeftModel``), as the
            canonical name of :func:`canonical_name` does; user-facing names keep it.

    Returns:
        the name with every :data:`WRAPPER_COMPONENTS` component that is followed by another
        component removed, wherever it occurs, then the leading components above, e.g.
        ``"module._fsdp_wrapped_module.layers.0._orig_mod.w"`` -> ``"layers.0.w"``.
    """
    parts = name.split(".")
    parts = [p for i, p in enumerate(parts) if p not in WRAPPER_COMPONENTS or i == len(parts) - 1]
    i = 0
    while strip_module:
        if i < len(parts) - 1 and parts[i] == "module":
            i += 1
        elif peft_root and i < len(parts) - 2 and parts[i] == "base_model" and parts[i + 1] == "model":
            i += 2
        else:
            break
    return ".".join(parts[i:])


_PEFT_RE = re.compile(
    r"^(?P<mod>.+?)\."
    r"(?:lora_(?P<ab>A|B)\.(?:[^.]+\.)?(?P<leaf>weight|bias)"
    r"|lora_(?P<bare>A|B)"
    r"|lora_embedding_(?P<eab>A|B)\.[^.]+"
    r"|lora_magnitude_vector\.[^.]+(?:\.weight)?)$"
)
_PEFT_DROP_RE = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def _canonical(name: str) -> tuple[str, str | None]:
    s = clean_name(name, peft_root=True)
    lora: str | None = None
    m = _PEFT_RE.match(s)
    if m is not None:
        if m["ab"]:
            lora, s = m["ab"], f"{m['mod']}.{m['leaf']}"
        elif m["bare"]:  # loralib: the adapter matrices are parameters of the layer itself
            lora, s = m["bare"], f"{m['mod']}.weight"
        elif m["eab"]:
            lora, s = f"embedding_{m['eab']}", f"{m['mod']}.weight"
        else:
            lora, s = "magnitude", f"{m['mod']}.weight"
    s = _PEFT_DROP_RE.sub("", s)
    return s, lora


def canonical_name(name: str) -> str:
    """Name with wrapper and PEFT components removed (step 1 of :mod:`distgrad.naming.classify`).

    Args:
        name: parameter name as given by ``Module.named_parameters()`` of the (wrapped) model.

    Returns:
        e.g. ``"model.layers.0.self_attn.q_proj.weight"`` for
        ``"module.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"``.
        LoRA/DoRA parameters map to ``<adapted module>.weight`` (``.bias`` for a LoRA bias).
    """
    return _canonical(name)[0]
