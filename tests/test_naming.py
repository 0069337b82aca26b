"""distgrad.naming.classify: classification of real parameter-name lists, wrapper invariance, user rules,
forward order.

Fixtures: tests/fixtures/param_names/<arch>.txt holds the parameter names of an architecture
(written from the public Hugging Face / PEFT / torchtitan module definitions), <arch>.tsv the
expected classification, one tab-separated line per name: name, layer, module_kind, lora ('-' for
None), module.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from distgrad.naming.classify import (
    MODULE_KINDS,
    ParamGroup,
    canonical_name,
    classify,
    forward_order_key,
)

FIXTURES = Path(__file__).parent / "fixtures" / "param_names"
ARCHS = sorted(p.stem for p in FIXTURES.glob("*.txt"))


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def load_names(arch: str) -> list[str]:
    return _lines(FIXTURES / f"{arch}.txt")


def load_expected(arch: str) -> list[tuple[str, str, str, str | None, str]]:
    rows = []
    for ln in _lines(FIXTURES / f"{arch}.tsv"):
        name, layer, kind, lora, module = ln.split("\t")
        rows.append((name, layer, kind, None if lora == "-" else lora, module))
    return rows


REQUIRED = {
    "llama", "mistral", "qwen2", "gpt2", "gpt_neox", "bloom", "falcon", "phi2", "phi3", "gemma",
    "chatglm", "t5", "example", "peft_lora_llama", "peft_dora_llama",
}


def test_fixture_set_complete():
    assert REQUIRED <= set(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_expected_file_matches_names(arch):
    names = load_names(arch)
    assert len(names) == len(set(names)), "duplicate names"
    assert [r[0] for r in load_expected(arch)] == names


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_has_blocks_embed_head_norm(arch):
    layers = {classify(n).layer for n in load_names(arch)}
    blocks = {l for l in layers if l.split(".")[-1].isdigit()}
    assert len(blocks) >= 2
    assert {"embed", "norm"} <= layers
    if arch != "gemma2":  # Gemma-2's lm_head is tied and absent from named_parameters()
        assert "head" in layers


@pytest.mark.parametrize("arch", ARCHS)
def test_classify_every_fixture_line(arch):
    mismatches = []
    for name, layer, kind, lora, module in load_expected(arch):
        got = classify(name)
        want = ParamGroup(layer=layer, module_kind=kind, lora=lora, module=module)
        if got != want:
            mismatches.append(f"{name}: got {got}, want {want}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("arch", ARCHS)
def test_builtin_kinds_are_canonical(arch):
    for name in load_names(arch):
        assert classify(name).module_kind in MODULE_KINDS


WRAPPERS = [
    "module.",
    "module.module.",
    "_fsdp_wrapped_module.",
    "_orig_mod.",
    "_checkpoint_wrapped_module.",
    "module._orig_mod.",
    "_orig_mod.module._fsdp_wrapped_module.",
]


def _insert_inner_wrappers(name: str) -> str:
    """FSDP1 auto-wrap / activation checkpointing per block: wrappers after the block index."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1] + ["_fsdp_wrapped_module", "_checkpoint_wrapped_module"] + parts[i + 1 :])
    return name


@pytest.mark.parametrize("arch", ARCHS)
def test_wrapper_prefixes_do_not_change_result(arch):
    for name in load_names(arch):
        want = classify(name)
        variants = [w + name for w in WRAPPERS]
        variants.append(_insert_inner_wrappers(name))
        variants.append("module." + _insert_inner_wrappers(name))
        if not name.startswith("base_model.model."):
            variants.append("base_model.model." + name)
            variants.append("_fsdp_wrapped_module.base_model.model." + _insert_inner_wrappers(name))
        for v in variants:
            assert classify(v) == want, v
            assert forward_order_key(v)[:-1] == forward_order_key(name)[:-1], v


def test_canonical_name():
    assert (
        canonical_name("module._orig_mod.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert canonical_name("base_model.model.model.embed_tokens.lora_embedding_B.default") == "model.embed_tokens.weight"
    assert (
        canonical_name("base_model.model.model.layers.3.mlp.up_proj.lora_magnitude_vector.default")
        == "model.layers.3.mlp.up_proj.weight"
    )  # older PEFT: DoRA magnitude as a ParameterDict entry
    assert canonical_name("base_model.model.lm_head.modules_to_save.other_adapter.weight") == "lm_head.weight"
    assert canonical_name("model.layers.0._checkpoint_wrapped_module.mlp.c_fc.bias") == "model.layers.0.mlp.c_fc.bias"


def test_lora_roles_and_adapter_names():
    g = classify("base_model.model.model.layers.7.self_attn.v_proj.lora_B.my_adapter.weight")
    assert g == ParamGroup("7", "attn_v", "B", "model.layers.7.self_attn.v_proj")
    g = classify("base_model.model.model.layers.7.self_attn.v_proj.lora_B.my_adapter.bias")  # lora_bias=True
    assert g == ParamGroup("7", "attn_v", "B", "model.layers.7.self_attn.v_proj")
    g = classify("base_model.model.transformer.h.2.attn.c_attn.lora_A.default.weight")  # GPT-2 Conv1D
    assert g == ParamGroup("2", "attn_qkv", "A", "transformer.h.2.attn.c_attn")
    g = classify("base_model.model.model.layers.1.mlp.down_proj.lora_magnitude_vector.default")
    assert g.lora == "magnitude" and g.module_kind == "mlp_down" and g.layer == "1"


def test_unmatched_keeps_own_name():
    assert classify("scalar_gate") == ParamGroup("other", "other", None, "scalar_gate")
    assert classify("module.foo.bar.weight") == ParamGroup("other", "other", None, "foo.bar.weight")
    # inside a recognised block, an unknown submodule keeps the block's layer
    assert classify("model.layers.4.mixer.A_log") == ParamGroup("4", "other", None, "model.layers.4.mixer.A_log")


def test_more_families():
    cases = {
        # Mixtral-style / DeepSeek MoE and MLA
        "model.layers.3.mlp.gate.e_score_correction_bias": ("3", "router"),
        "model.layers.3.mlp.shared_experts.down_proj.weight": ("3", "expert"),
        "model.layers.3.self_attn.q_a_proj.weight": ("3", "attn_q"),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ("3", "attn_kv"),
        "model.layers.3.self_attn.kv_a_layernorm.weight": ("3", "norm"),
        # Qwen3 / Gemma3 qk-norm
        "model.layers.5.self_attn.q_norm.weight": ("5", "norm"),
        # torchtitan MoE (grouped expert weights without .weight)
        "layers.2.moe.experts.w1": ("2", "expert"),
        "layers.2.moe.router.gate.weight": ("2", "router"),
        # DeepSpeed MoE (deepspeed.moe.layer.MoE), experts under their global index
        "layers.2.moe.deepspeed_moe.gate.wg.weight": ("2", "router"),
        "layers.2.moe.deepspeed_moe.experts.deepspeed_experts.3.0.weight": ("2", "expert"),
        "blocks.1.mlp.deepspeed_moe.experts.deepspeed_experts.12.2.bias": ("1", "expert"),
        # nn.TransformerEncoder
        "encoder.layers.1.self_attn.in_proj_weight": ("enc.1", "attn_qkv"),
        "encoder.layers.1.self_attn.out_proj.weight": ("enc.1", "attn_out"),
        "encoder.layers.1.linear1.weight": ("enc.1", "mlp_up"),
        "encoder.layers.1.linear2.weight": ("enc.1", "mlp_down"),
        "encoder.layers.1.norm2.weight": ("enc.1", "norm"),
        # MPT
        "transformer.blocks.0.attn.Wqkv.weight": ("0", "attn_qkv"),
        "transformer.blocks.0.ffn.down_proj.weight": ("0", "mlp_down"),
        "transformer.norm_f.weight": ("norm", "norm"),
        # BERT
        "bert.embeddings.word_embeddings.weight": ("embed", "embed"),
        "bert.embeddings.position_embeddings.weight": ("embed", "pos_embed"),
        "bert.embeddings.LayerNorm.weight": ("embed", "norm"),
        "bert.encoder.layer.11.attention.self.query.weight": ("enc.11", "attn_q"),
        "bert.encoder.layer.11.attention.output.dense.weight": ("enc.11", "attn_out"),
        "bert.encoder.layer.11.intermediate.dense.weight": ("enc.11", "mlp_up"),
        "bert.encoder.layer.11.output.dense.weight": ("enc.11", "mlp_down"),
        # BART decoder, Whisper encoder
        "model.decoder.layers.0.encoder_attn.k_proj.weight": ("dec.0", "xattn_k"),
        "model.decoder.layers.0.fc1.weight": ("dec.0", "mlp_up"),
        "model.encoder.layer_norm.weight": ("norm", "norm"),
        # sequence classification head
        "score.weight": ("head", "cls_head"),
    }
    for name, (layer, kind) in cases.items():
        g = classify(name)
        assert (g.layer, g.module_kind) == (layer, kind), name


def test_user_rules_take_precedence_and_use_groups():
    rules = [
        (r"^model\.layers\.(\d+)\.mlp\.", r"\1", "mlp_custom"),
        (r"^trunk\.stage(?P<s>\d)\.unit(\d+)\.", r"s\g<s>.\2", "unit"),
        (r"^my_head\.", "head", "lm_head"),
    ]
    assert classify("model.layers.12.mlp.up_proj.weight", rules) == ParamGroup(
        "12", "mlp_custom", None, "model.layers.12.mlp.up_proj"
    )
    # rules see the canonical name: wrappers and PEFT parts removed
    assert classify("module.base_model.model.model.layers.2.mlp.down_proj.lora_A.default.weight", rules) == ParamGroup(
        "2", "mlp_custom", "A", "model.layers.2.mlp.down_proj"
    )
    assert classify("_orig_mod.trunk.stage3.unit14.conv.weight", rules) == ParamGroup(
        "s3.14", "unit", None, "trunk.stage3.unit14.conv"
    )
    assert classify("my_head.bias", rules).layer == "head"
    # non-matching names fall through to the built-ins
    assert classify("model.layers.12.self_attn.q_proj.weight", rules).module_kind == "attn_q"
    # rules given as lists / tuples of lists behave the same (cached by value)
    assert classify("my_head.bias", [list(r) for r in rules]) == classify("my_head.bias", tuple(rules))


def test_user_rule_errors():
    with pytest.raises(ValueError):
        classify("x.weight", [(r"(", "a", "b")])
    with pytest.raises(ValueError):
        classify("x.weight", [(r"x", r"\3", "b")])
    with pytest.raises(ValueError):
        classify("x.weight", [(r"x", "a")])
    with pytest.raises(ValueError):
        classify("x.weight", ["x"])


def test_param_group_is_frozen():
    g = classify("lm_head.weight")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.layer = "x"  # type: ignore[misc]


def _shuffled_sort(names: list[str], seed: int = 0) -> list[str]:
    shuffled = list(names)
    random.Random(seed).shuffle(shuffled)
    return sorted(shuffled, key=forward_order_key)


def test_forward_order_llama_many_layers():
    names = ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"]
    for i in range(12):
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            names.append(f"model.layers.{i}.{m}.weight")
    order = _shuffled_sort(names)
    assert order[0] == "model.embed_tokens.weight"
    assert order[-2:] == ["model.norm.weight", "lm_head.weight"]
    blocks = [int(n.split(".")[2]) for n in order[1:-2]]
    assert blocks == sorted(blocks)  # numeric: 2 < 10
    block0 = [n.split(".", 3)[3].rsplit(".", 1)[0] for n in order[1:10]]
    assert block0 == ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                      "mlp.down_proj"]


def test_forward_order_t5():
    names = load_names("t5")
    order = _shuffled_sort(names, seed=1)
    layers = [classify(n).layer for n in order]
    first_enc = layers.index("enc.0")
    enc_norm = order.index("encoder.final_layer_norm.weight")
    first_dec = layers.index("dec.0")
    dec_norm = order.index("decoder.final_layer_norm.weight")
    assert set(layers[:first_enc]) == {"embed"}
    assert first_enc < enc_norm < first_dec < dec_norm < order.index("lm_head.weight") == len(order) - 1
    dec0 = [n for n in order if n.startswith("decoder.block.0.")]
    assert dec0[0].endswith("layer.0.layer_norm.weight")
    assert dec0.index("decoder.block.0.layer.1.layer_norm.weight") < dec0.index(
        "decoder.block.0.layer.1.EncDecAttention.q.weight"
    )
    assert dec0[-1] == "decoder.block.0.layer.2.DenseReluDense.wo.weight"


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "example", "peft_lora_llama", "peft_dora_llama", "chatglm"])
def test_forward_order_stages(arch):
    order = _shuffled_sort(load_names(arch), seed=2)
    stage = {"embed": 0, "norm": 2, "head": 3}
    seq = [stage.get(classify(n).layer, 1) for n in order]
    assert seq == sorted(seq)
    # base weight, then LoRA A, then B (then DoRA magnitude) within one module
    for i, n in enumerate(order[:-1]):
        g, h = classify(n), classify(order[i + 1])
        if g.module == h.module and g.lora == "A":
            assert h.lora == "B"


def test_forward_order_unknown_last_and_user_rules():
    names = ["zzz.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"]
    assert sorted(names, key=forward_order_key)[-1] == "zzz.weight"
    rules = [(r"^zzz", "embed", "embed")]
    order = sorted(names, key=lambda n: forward_order_key(n, rules))
    assert set(order[:2]) == {"zzz.weight", "model.embed_tokens.weight"}


@pytest.mark.parametrize("name,module,lora", [
    ("blocks.0.attn.qkv.lora_A.weight", "blocks.0.attn.qkv", "A"),          # no adapter name
    ("model.layers.3.self_attn.q_proj.lora_B", "model.layers.3.self_attn.q_proj", "B"),  # loralib
    ("model.layers.3.self_attn.q_proj.lora_A.default.weight", "model.layers.3.self_attn.q_proj", "A"),
])
def test_lora_spellings(name, module, lora):
    g = classify(name)
    assert (g.module, g.lora) == (module, lora)
    assert g.layer in ("0", "3") and g.module_kind in ("attn_qkv", "attn_q")
