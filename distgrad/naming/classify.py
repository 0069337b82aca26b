"""Map parameter names to (layer, module kind, LoRA role, module path).

Every exported per-layer or per-kind statistic (``distgrad_layer_grad_*{layer}``,
``distgrad_module_kind_grad_norm{module_kind}``) is a re-aggregation over the groups this module
assigns. The label values are bounded: ``layer`` is a block index written as a decimal string
(``"3"``; ``"enc.3"`` / ``"dec.3"`` in encoder-decoder stacks) or one of ``embed``, ``head``,
``norm`` (the final norm) and ``other``; ``module_kind`` is one of :data:`MODULE_KINDS` (or a
string from a user rule).

Classification of one name, in this order:

1. **Canonical name** (:func:`distgrad.naming.canonical.clean_name`). Wrapper components are removed:
   ``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``, ``_orig_mod`` and
   ``_forward_module`` wherever they occur, then leading ``module.`` (DDP / DeepSpeed,
   repeated) and a leading ``base_model.model.`` (PEFT).
   PEFT parts are removed and remembered: ``<m>.base_layer.<leaf>`` -> ``<m>.<leaf>``;
   ``<m>.lora_A.<adapter>.<leaf>`` (PEFT), ``<m>.lora_A.<leaf>`` (no adapter name) and
   ``<m>.lora_A`` (Microsoft loralib) -> ``<m>.<leaf>`` with ``lora="A"`` (``B`` likewise);
   ``<m>.lora_embedding_A.<adapter>`` -> ``<m>.weight`` with ``lora="embedding_A"``
   (``embedding_B`` likewise); ``<m>.lora_magnitude_vector.<adapter>[.weight]`` (DoRA) ->
   ``<m>.weight`` with ``lora="magnitude"``; ``modules_to_save.<adapter>`` and
   ``original_module`` components are dropped. So a LoRA parameter is classified exactly like the
   weight of the layer it adapts, and wrappers never change the result.
2. **User rules** ``(regex, layer_template, module_kind)``, in the order given: the first whose
   ``regex`` is found (:func:`re.search`) in the canonical name wins; the layer is
   ``match.expand(layer_template)`` (so ``\\1`` / ``\\g<name>`` refer to the regex's groups).
3. **Top-level table** :data:`TOP_LEVEL_RULES` (parameters outside the blocks, plus
   architecture-specific overrides), matched against the canonical name. The prefix
   ``(?:[A-Za-z_]\\w*\\.)*?`` admits any number of *non-numeric* path components, so these rules
   never match a parameter inside an indexed block (``...layers.3....``).
4. **Blocks.** :data:`BLOCK_RE` finds the first indexed container (``layers``, ``layer``, ``h``,
   ``blocks``, ``block``) whose components before it are non-numeric; its index is the layer.
   If the container sits directly under a component named ``encoder`` (``decoder``) the layer is
   prefixed ``enc.`` (``dec.``): T5 ``encoder.block.3`` -> ``"enc.3"``, BART/Whisper alike.
   Exception: ChatGLM's decoder-only stack ``transformer.encoder.layers`` stays unprefixed.
   The path inside the block, without the trailing ``.weight``/``.bias``, is then matched in full
   (:func:`re.fullmatch`) against :data:`IN_BLOCK_RULES` in order; no match gives
   ``module_kind="other"`` (the layer is still the block's).
5. Anything else: ``layer="other"``, ``module_kind="other"``, ``module`` = the canonical name.

``module`` is the canonical name without its trailing ``.weight``/``.bias`` (e.g.
``model.layers.0.self_attn.q_proj`` for the base weight, its bias and its LoRA A/B/magnitude).

Built-in coverage (names from the public Hugging Face ``modeling_*.py`` definitions and the
projects' own checkpoints; fixtures in ``tests/fixtures/param_names``):

======================  =======================================================================
family                  block names -> module_kind
======================  =======================================================================
LLaMA/Mistral/Qwen2/     ``model.layers.N.self_attn.{q,k,v,o}_proj`` -> attn_q/k/v/out,
Gemma(2/3)/Qwen3         ``mlp.{gate,up,down}_proj`` -> mlp_gate/up/down, ``input_layernorm``,
                         ``post_attention_layernorm``, ``{pre,post}_feedforward_layernorm``,
                         ``self_attn.{q,k}_norm`` -> norm; ``model.embed_tokens`` -> embed,
                         ``model.norm`` -> norm, ``lm_head`` -> lm_head
Mixtral / Qwen-MoE /     ``block_sparse_moe.gate``, ``mlp.gate``, ``mlp.shared_expert_gate`` ->
DeepSeek                 router; ``...experts.E.*``, ``mlp.shared_expert(s).*`` -> expert;
                         ``self_attn.q_{a,b}_proj`` -> attn_q, ``kv_a_proj_with_mqa``,
                         ``kv_b_proj`` -> attn_kv
DeepSpeed MoE            ``<moe>.deepspeed_moe.gate.wg`` -> router,
                         ``<moe>.deepspeed_moe.experts.deepspeed_experts.E.*`` -> expert
Phi-3                    ``self_attn.qkv_proj`` -> attn_qkv, ``mlp.gate_up_proj`` -> mlp_gate_up
Phi-2 (HF / remote)      ``self_attn.dense`` -> attn_out, ``mlp.fc1``/``fc2`` -> mlp_up/down,
                         ``model.final_layernorm`` -> norm; remote code ``mixer.Wqkv``,
                         ``mixer.out_proj``, ``ln``, ``lm_head.ln`` (norm), ``lm_head.linear``
GPT-2                    ``transformer.h.N.attn.c_attn`` -> attn_qkv, ``attn.c_proj`` -> attn_out,
                         ``mlp.c_fc``/``c_proj`` -> mlp_up/down, ``ln_1``/``ln_2``;
                         ``transformer.wte`` embed, ``wpe`` pos_embed, ``ln_f`` norm
GPT-NeoX                 ``gpt_neox.layers.N.attention.query_key_value``/``dense``,
                         ``mlp.dense_h_to_4h``/``dense_4h_to_h``; ``embed_in``, ``embed_out``,
                         ``final_layer_norm``
BLOOM / Falcon           ``transformer.h.N.self_attention.query_key_value``/``dense``,
                         ``mlp.dense_h_to_4h``/``dense_4h_to_h``, Falcon-40B ``ln_attn``/
                         ``ln_mlp``; ``word_embeddings``, ``word_embeddings_layernorm``
                         (layer embed, kind norm)
ChatGLM2/3, GLM-4        ``transformer.encoder.layers.N.self_attention.query_key_value``,
(remote code)            ``mlp.dense_h_to_4h`` -> **mlp_gate_up** (SwiGLU, fused),
                         ``transformer.embedding.word_embeddings``,
                         ``transformer.encoder.final_layernorm``, ``transformer.output_layer``
T5 / mT5 / Flan-T5       ``{en,de}coder.block.N.layer.0.SelfAttention.{q,k,v,o}`` -> attn_*,
                         ``relative_attention_bias`` -> attn_rel_bias,
                         ``layer.1.EncDecAttention.*`` -> xattn_q/k/v/out,
                         ``DenseReluDense.wi`` (``wi_1``) -> mlp_up, ``wi_0`` -> mlp_gate,
                         ``wo`` -> mlp_down, ``layer.K.layer_norm`` -> norm; ``shared``,
                         ``{en,de}coder.embed_tokens`` -> embed, ``{en,de}coder.final_layer_norm``
                         -> layer norm
Meta / torchtitan LLaMA  ``layers.N.attention.w{q,k,v,o}``, ``feed_forward.w1/w3/w2`` ->
                         mlp_gate/up/down, ``attention_norm``, ``ffn_norm``; ``tok_embeddings``,
                         ``norm``, ``output``; MoE ``moe.router.gate``, ``moe.experts.w*``
MPT, BERT, nn.Transformer ``attn.Wqkv``/``out_proj``, ``ffn.up_proj``/``down_proj``;
                         ``attention.self.query``..., ``intermediate.dense``, ``output.dense``;
                         ``self_attn.in_proj_weight``, ``linear1``/``linear2``, ``norm1``/``norm2``
distgrad example model   ``tok_emb`` embed, ``pos_emb`` pos_embed, ``blocks.N.ln1``/``ln2`` norm,
                         ``attn.qkv`` attn_qkv, ``attn.proj`` attn_out, ``mlp.fc`` mlp_up,
                         ``mlp.proj`` mlp_down, ``ln_f`` norm, ``head`` lm_head
======================  =======================================================================

Tied weights (GPT-2/BLOOM/Falcon/Gemma ``lm_head.weight``, T5 ``encoder.embed_tokens``) are one
``Parameter`` and appear once in ``named_parameters()``; the name that appears is classified.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MODULE_KINDS",
    "LORA_ROLES",
    "TOP_LEVEL_RULES",
    "IN_BLOCK_RULES",
    "BLOCK_RE",
    "ParamGroup",
    "canonical_name",
    "classify",
    "forward_order_key",
]

#: Canonical ``module_kind`` values of the built-in tables, in forward order inside a block.
MODULE_KINDS: tuple[str, ...] = (
    "embed",  # token embedding (also token-type embedding)
    "pos_embed",  # learned absolute position embedding
    "norm",  # any normalisation layer (block norms, qk-norm, embedding norm, final norm)
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_kv",  # fused K/V or low-rank KV projection (DeepSeek MLA)
    "attn_qkv",  # fused Q/K/V projection
    "attn_rel_bias",  # T5 relative position bias (block 0 only)
    "attn_out",
    "xattn_q",  # cross-attention (T5 EncDecAttention, BART encoder_attn, GPT-2 crossattention)
    "xattn_k",
    "xattn_v",
    "xattn_kv",
    "xattn_out",
    "router",  # MoE gate / router (incl. shared-expert gate)
    "expert",  # MoE expert weights (routed and shared experts)
    "mlp_gate",
    "mlp_up",
    "mlp_gate_up",  # fused gate+up (Phi-3, ChatGLM dense_h_to_4h)
    "mlp_down",
    "lm_head",
    "cls_head",  # classification / score head
    "other",
)

#: Values of :attr:`ParamGroup.lora` other than None.
LORA_ROLES: tuple[str, ...] = ("A", "B", "embedding_A", "embedding_B", "magnitude")


@dataclass(frozen=True)
class ParamGroup:
    """Where one parameter belongs.

    Attributes:
        layer: block index as a decimal string (``"3"``), ``"enc.3"``/``"dec.3"`` for blocks of an
            encoder-decoder's encoder/decoder stack, or ``"embed"``, ``"head"``, ``"norm"``
            (final norm), ``"other"``.
        module_kind: one of :data:`MODULE_KINDS` (or a user rule's kind).
        lora: ``"A"``, ``"B"``, ``"embedding_A"``, ``"embedding_B"``, ``"magnitude"`` (DoRA
            ``lora_magnitude_vector``), or None for ordinary parameters (incl. ``base_layer``).
        module: canonical module path: wrappers and PEFT parts removed, without the trailing
            ``.weight``/``.bias``; for unmatched parameters the canonical name itself.
    """

    layer: str
    module_kind: str
    lora: str | None
    module: str


from distgrad.naming.canonical import _canonical, canonical_name  # noqa: E402 - re-exported

_LEAF_RE = re.compile(r"\.(?:weight|bias)$")


# --------------------------------------------------------------------------------------------
# Built-in tables
# --------------------------------------------------------------------------------------------

# Any number of non-numeric path components (never crosses an indexed block "layers.3.").
_ROOT = r"^(?:[A-Za-z_]\w*\.)*?"
_LEAF = r"\.(?:weight|bias)$"

# Forward-order stages (first element of forward_order_key).
_ST_EMBED, _ST_ENC, _ST_ENC_NORM, _ST_BLOCK, _ST_NORM, _ST_HEAD, _ST_OTHER = range(7)
_LAYER_STAGE = {"embed": _ST_EMBED, "norm": _ST_NORM, "head": _ST_HEAD, "other": _ST_OTHER}

#: Top-level rules: (regex searched in the canonical name, layer template, module_kind), in order.
#: The first two are ChatGLM overrides (its decoder stack is called ``encoder`` and its fused
#: ``dense_h_to_4h`` is gate+up, unlike NeoX/BLOOM/Falcon where it is the up projection).
TOP_LEVEL_RULES: tuple[tuple[str, str, str], ...] = (
    (r"^transformer\.encoder\.layers\.(\d+)\.mlp\.dense_h_to_4h" + _LEAF, r"\1", "mlp_gate_up"),
    (r"^transformer\.encoder\.final_layernorm" + _LEAF, "norm", "norm"),
    (_ROOT + r"lm_head\.ln" + _LEAF, "norm", "norm"),  # phi-2 remote code: final norm in head
    (_ROOT + r"lm_head\.linear" + _LEAF, "head", "lm_head"),
    (
        _ROOT + r"(?:embed_tokens|tok_embeddings|tok_emb|wte|word_embeddings|embed_in|shared"
        r"|token_type_embeddings)" + _LEAF,
        "embed",
        "embed",
    ),
    (
        _ROOT + r"(?:wpe|pos_emb|pos_embed|pos_embedding|embed_positions|position_embeddings)"
        + _LEAF,
        "embed",
        "pos_embed",
    ),
    (
        _ROOT + r"(?:word_embeddings_layernorm|layernorm_embedding|embed_layer_norm"
        r"|embeddings\.LayerNorm|emb_ln|ln_emb)" + _LEAF,
        "embed",
        "norm",
    ),
    # final norm of an encoder stack (T5, BART, Whisper): layer "norm", ordered after the encoder
    (
        _ROOT + r"encoder\.(?:final_layer_norm|final_layernorm|layer_norm|layernorm|norm|ln_f)"
        + _LEAF,
        "norm",
        "norm",
    ),
    (
        _ROOT + r"(?:norm|ln_f|norm_f|final_layer_norm|final_layernorm|final_norm|layer_norm"
        r"|layernorm|ln_out)" + _LEAF,
        "norm",
        "norm",
    ),
    (_ROOT + r"(?:lm_head|embed_out|output_layer|output|head)" + _LEAF, "head", "lm_head"),
    (_ROOT + r"(?:score|classifier|cls_head)" + _LEAF, "head", "cls_head"),
)
# stage / in-block position of each top-level rule (parallel to TOP_LEVEL_RULES)
_TOP_ORDER: tuple[tuple[int, int], ...] = (
    (_ST_BLOCK, 34),
    (_ST_NORM, 0),
    (_ST_NORM, 0),
    (_ST_HEAD, 0),
    (_ST_EMBED, 0),
    (_ST_EMBED, 1),
    (_ST_EMBED, 5),
    (_ST_ENC_NORM, 0),
    (_ST_NORM, 0),
    (_ST_HEAD, 0),
    (_ST_HEAD, 1),
)

#: Locates a block: first indexed container after non-numeric components.
BLOCK_RE = re.compile(
    r"^(?P<stack>(?:[A-Za-z_]\w*\.)*?)(?:layers|layer|h|blocks|block)\.(?P<idx>\d+)\.(?P<rest>.+)$"
)

_A = r"(?:self_attn|attn|attention|self_attention|mixer|attention\.self|layer\.0\.SelfAttention)"
_X = r"(?:layer\.1\.EncDecAttention|encoder_attn|crossattention|cross_attn)"
_M = r"(?:mlp|feed_forward|ffn|layer\.[12]\.DenseReluDense)"
_MOE = r"(?:mlp|block_sparse_moe|moe|feed_forward|ffn)"

#: In-block rules: (regex matched in full against the path inside the block without the trailing
#: ``.weight``/``.bias``, module_kind, position in forward order within the block), in order.
IN_BLOCK_RULES: tuple[tuple[str, str, int], ...] = (
    # norms, by position in the block
    (
        r"input_layernorm|ln_1|ln1|ln_attn|attention_norm|attn_norm|norm_1|norm1|ln|layernorm"
        r"|pre_attention_layernorm|self_attn_layer_norm|layer\.0\.layer_norm",
        "norm",
        0,
    ),
    (_A + r"\.(?:q_norm|k_norm|q_layernorm|k_layernorm|q_a_layernorm|kv_a_layernorm)", "norm", 15),
    (r"post_attention_layernorm|attention\.output\.LayerNorm", "norm", 19),
    (r"encoder_attn_layer_norm|ln_cross_attn|layer\.1\.layer_norm", "norm", 20),
    (
        r"ln_2|ln2|ln_mlp|ffn_norm|norm_2|norm2|pre_feedforward_layernorm|final_layer_norm"
        r"|layer\.2\.layer_norm",
        "norm",
        29,
    ),
    (r"post_feedforward_layernorm|output\.LayerNorm", "norm", 39),
    # self-attention
    (_A + r"\.(?:q_proj|q|wq|query|q_a_proj|q_b_proj)", "attn_q", 10),
    (_A + r"\.(?:k_proj|k|wk|key)", "attn_k", 11),
    (_A + r"\.(?:v_proj|v|wv|value)", "attn_v", 12),
    (_A + r"\.(?:kv_proj|kv_a_proj_with_mqa|kv_b_proj)", "attn_kv", 13),
    (
        _A + r"\.(?:qkv_proj|qkv|query_key_value|c_attn|Wqkv|W_pack|in_proj_weight|in_proj_bias)",
        "attn_qkv",
        14,
    ),
    (_A + r"\.relative_attention_bias", "attn_rel_bias", 16),
    (_A + r"\.(?:o_proj|o|wo|out_proj|c_proj|dense|proj|output\.dense)", "attn_out", 18),
    # cross-attention
    (_X + r"\.(?:q_proj|q|query|q_attn)", "xattn_q", 21),
    (_X + r"\.(?:k_proj|k|key)", "xattn_k", 22),
    (_X + r"\.(?:v_proj|v|value)", "xattn_v", 23),
    (_X + r"\.(?:c_attn|kv_proj)", "xattn_kv", 24),
    (_X + r"\.(?:o_proj|o|out_proj|c_proj|dense)", "xattn_out", 25),
    # mixture of experts (before the dense MLP: Qwen-MoE/DeepSeek call the router mlp.gate)
    (_MOE + r"\.(?:gate|router|shared_expert_gate)(?:\.\w+)?", "router", 30),
    (_MOE + r"\.(?:experts|shared_experts?)(?:\..+)?", "expert", 31),
    # DeepSpeed MoE (deepspeed.moe.layer.MoE; experts renamed to their global index by distgrad)
    (_MOE + r"\.deepspeed_moe\.gate(?:\.\w+)?", "router", 30),
    (_MOE + r"\.deepspeed_moe\.experts(?:\..+)?", "expert", 31),
    # dense MLP
    (_M + r"\.(?:gate_proj|w1|wi_0)", "mlp_gate", 32),
    (
        _M + r"\.(?:up_proj|w3|wi_1|wi|c_fc|fc1|fc|fc_in|dense_h_to_4h|linear_1)"
        r"|intermediate\.dense|fc1|linear1",
        "mlp_up",
        33,
    ),
    (_M + r"\.gate_up_proj", "mlp_gate_up", 34),
    (
        _M + r"\.(?:down_proj|w2|wo|c_proj|fc2|proj|fc_out|dense_4h_to_h|linear_2)"
        r"|output\.dense|fc2|linear2",
        "mlp_down",
        35,
    ),
)

_TOP_COMPILED = tuple(
    (re.compile(p), layer, kind, stage, pos)
    for (p, layer, kind), (stage, pos) in zip(TOP_LEVEL_RULES, _TOP_ORDER, strict=True)
)
_IN_BLOCK_COMPILED = tuple((re.compile(p), kind, pos) for p, kind, pos in IN_BLOCK_RULES)
_KIND_POS = {
    "embed": 0,
    "pos_embed": 1,
    "norm": 0,
    "lm_head": 0,
    "cls_head": 1,
    "other": 99,
    **{k: pos for _, k, pos in IN_BLOCK_RULES if k != "norm"},
}


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Info:
    group: ParamGroup
    stage: int
    block: int
    pos: int
    leaf: int


def _freeze_rules(rules: Sequence[tuple[str, str, str]] | None) -> tuple[tuple[str, str, str], ...]:
    if not rules:
        return ()
    out = []
    for r in rules:
        if isinstance(r, str) or len(r) != 3 or not all(isinstance(x, str) for x in r):
            raise ValueError(f"a naming rule is (regex, layer_template, module_kind) strings, got {r!r}")
        out.append((r[0], r[1], r[2]))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _compile_rules(rules: tuple[tuple[str, str, str], ...]) -> tuple[tuple[re.Pattern[str], str, str], ...]:
    compiled = []
    for pattern, layer, kind in rules:
        try:
            compiled.append((re.compile(pattern), layer, kind))
        except re.error as e:
            raise ValueError(f"invalid naming rule regex {pattern!r}: {e}") from None
    return tuple(compiled)


def _stage_of_layer(layer: str) -> tuple[int, int]:
    if layer in _LAYER_STAGE:
        return _LAYER_STAGE[layer], 0
    m = re.fullmatch(r"(enc\.|dec\.)?(\d+)", layer)
    if m is None:
        return _ST_OTHER, 0
    return (_ST_ENC if m[1] == "enc." else _ST_BLOCK), int(m[2])


@functools.lru_cache(maxsize=1 << 16)
def _info(name: str, rules: tuple[tuple[str, str, str], ...]) -> _Info:
    canon, lora = _canonical(name)
    leaf_m = _LEAF_RE.search(canon)
    module = canon[: leaf_m.start()] if leaf_m else canon
    leaf = 0 if canon.endswith(".weight") else 1 if leaf_m else 2

    for rx, template, kind in _compile_rules(rules):
        m = rx.search(canon)
        if m is not None:
            try:
                layer = m.expand(template)
            except (re.error, IndexError) as e:
                raise ValueError(f"naming rule {rx.pattern!r}: bad layer template {template!r}: {e}") from None
            stage, block = _stage_of_layer(layer)
            return _Info(ParamGroup(layer, kind, lora, module), stage, block, _KIND_POS.get(kind, 99), leaf)

    for rx, template, kind, stage, pos in _TOP_COMPILED:
        m = rx.search(canon)
        if m is not None:
            layer = m.expand(template)
            block = int(layer) if layer.isdigit() else 0
            return _Info(ParamGroup(layer, kind, lora, module), stage, block, pos, leaf)

    b = BLOCK_RE.match(canon)
    if b is not None:
        stack = b["stack"][:-1]
        last = stack.rsplit(".", 1)[-1]
        if last == "encoder" and stack != "transformer.encoder":  # ChatGLM: decoder-only
            layer, stage = f"enc.{b['idx']}", _ST_ENC
        elif last == "decoder":
            layer, stage = f"dec.{b['idx']}", _ST_BLOCK
        else:
            layer, stage = b["idx"], _ST_BLOCK
        rest = b["rest"]
        rl = _LEAF_RE.search(rest)
        inner = rest[: rl.start()] if rl else rest
        kind, pos = "other", 99
        for rx, k, p in _IN_BLOCK_COMPILED:
            if rx.fullmatch(inner):
                kind, pos = k, p
                break
        return _Info(ParamGroup(layer, kind, lora, module), stage, int(b["idx"]), pos, leaf)

    return _Info(ParamGroup("other", "other", lora, canon), _ST_OTHER, 0, 99, leaf)


def classify(name: str, rules: Sequence[tuple[str, str, str]] | None = None) -> ParamGroup:
    """Classify one parameter name.

    Args:
        name: parameter name from ``Module.named_parameters()``, possibly wrapped (``module.``,
            ``_fsdp_wrapped_module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``,
            ``base_model.model.``) and possibly a PEFT LoRA/DoRA parameter.
        rules: optional user rules ``(regex, layer_template, module_kind)`` tried, in order,
            before the built-in tables. ``regex`` is searched (:func:`re.search`) in the canonical
            name (see :func:`canonical_name`; e.g. ``model.layers.3.self_attn.q_proj.weight``);
            ``layer_template`` is expanded with :meth:`re.Match.expand`, so ``r"\\1"`` is the
            first group; ``module_kind`` is used verbatim.

    Returns:
        :class:`ParamGroup`. Deterministic and cached (pure function of ``name`` and ``rules``).

    Raises:
        ValueError: a rule is not a 3-tuple of strings, its regex does not compile, or its layer
            template refers to a group the regex does not have.

    Mapping: see the module docstring, :data:`TOP_LEVEL_RULES` and :data:`IN_BLOCK_RULES`.
    """
    return _info(name, _freeze_rules(rules)).group


_LORA_RANK = {None: 0, "A": 1, "embedding_A": 1, "B": 2, "embedding_B": 2, "magnitude": 3}


def _natural(s: str) -> tuple:
    parts = re.split(r"(\d+)", s)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts))


def forward_order_key(name: str, rules: Sequence[tuple[str, str, str]] | None = None) -> tuple:
    """Sort key putting parameter names in model (forward) order.

    Order: embeddings (token, position, embedding norm); encoder blocks by index then the
    encoder's final norm (encoder-decoder models); blocks by index (decoder blocks); the final
    norm; the head; unclassified parameters last. Inside a block: pre-attention norm, Q, K, V,
    fused QKV, qk-norm, attention out, post-attention norm, cross-attention, pre-MLP norm, router,
    experts, gate, up, gate+up, down, post-MLP norm, other; then by module path with numbers
    compared numerically (``experts.2`` before ``experts.10``), base weight before LoRA A, B,
    magnitude, ``.weight`` before ``.bias``; the full name breaks remaining ties.

    Args:
        name: parameter name (wrappers allowed, as for :func:`classify`).
        rules: user rules as for :func:`classify`. A user-rule layer ``"N"``/``"dec.N"`` sorts as
            block N, ``"enc.N"`` as encoder block N, ``embed``/``norm``/``head`` as such, any
            other layer string after everything else.

    Returns:
        A tuple of ints, strings and tuples, comparable across all names:
        ``sorted(names, key=forward_order_key)``.

    Raises:
        ValueError: as :func:`classify` for invalid rules.
    """
    i = _info(name, _freeze_rules(rules))
    g = i.group
    return (i.stage, i.block, i.pos, _natural(g.module), _LORA_RANK.get(g.lora, 4), i.leaf, name)
