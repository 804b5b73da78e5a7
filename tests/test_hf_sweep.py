"""The hf family over transformers model types it was not written for: each equals transformers itself.

For every type below (tiny configs, eager, one thread) `_hf_sweep.outcome` checks the family's init
against a model transformers builds and initializes for real (each parameter's mean and std; every
buffer exactly), trains unstaged and staged against the plain PyTorch loop on transformers' own
module, and every layer against the function it shares; what the family cannot stage (or build) it
refuses in one line. The outcome of each type is pinned here and listed in docs/guide.md. The fast
tier runs the types the outside checks found wrong; the whole suite runs them all.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import _hf_sweep as sweep  # noqa: E402

from functrain import rng  # noqa: E402
from functrain.models import hf  # noqa: E402

STAGE_REFUSED = "unstaged only"
# type -> (config values beyond the tiny shape, the outcome's kind)
TYPES = {
    # the outside checks' findings, in the fast tier
    "gpt2": ({}, "trains"),  # depth-scaled c_proj init
    "xglm": ({}, STAGE_REFUSED),  # its stages composed differ from its forward
    "diffllama": ({}, "trains"),  # lambda depends on the layer index: no shared layer function
    "apertus": ({}, "trains"),  # xIELU's buffers made in __init__
    "gpt_bigcode": ({}, "trains"),  # depth-scaled init
    "openai-gpt": ({}, STAGE_REFUSED),  # init std 0.02 (was 0.485); no decoder layer list to stage
    "smollm3": ({"num_hidden_layers": 4}, "trains"),  # a NoPE layer among rotary ones
    "gptj": ({"rotary_dim": 4}, STAGE_REFUSED),  # a head bias
    "bloom": ({}, STAGE_REFUSED),  # word_embeddings_layernorm
    "olmo": ({}, STAGE_REFUSED),  # no final norm with parameters
    "biogpt": ({}, STAGE_REFUSED),  # no _no_split_modules
    "mamba": ({}, "trains"),  # no attention; built for real
    "dbrx": ({}, "refused"),  # a mixture of experts (ffn_config)
    # the rest, in the whole suite
    "llama": ({}, "trains"),
    "qwen2": ({}, "trains"),
    "mistral": ({}, "trains"),
    "gemma": ({}, "trains"),
    "phi3": ({}, "trains"),
    "qwen3": ({}, "trains"),
    "olmo2": ({}, "trains"),
    "opt": ({}, "trains"),
    "falcon": ({"drop": ("head_dim",)}, "trains"),
    "gpt_neox": ({}, "trains"),
    "stablelm": ({}, "trains"),
    "starcoder2": ({}, "trains"),
    "cohere": ({}, STAGE_REFUSED),
    "granite": ({}, STAGE_REFUSED),
    "mpt": ({}, "trains"),
    "persimmon": ({}, "trains"),
    "olmo3": ({}, "trains"),
    "nemotron": ({}, "trains"),
    "glm": ({}, "trains"),
    "glm4": ({}, "trains"),
    "helium": ({}, "trains"),
    "exaone4": ({}, "trains"),
    "gemma3_text": ({}, "trains"),
    "vaultgemma": ({}, STAGE_REFUSED),
    "gpt_neo": ({"attention_types": [[["global", "local"], 1]], "num_layers": 2, "drop": ("head_dim",)}, "trains"),
    "bitnet": ({}, "trains"),
    "ernie4_5": ({}, "trains"),
    "seed_oss": ({}, "trains"),
    "hunyuan_v1_dense": ({}, "trains"),
    "arcee": ({}, "trains"),
    "ministral": ({}, "trains"),
    "cwm": ({}, "trains"),
    "rwkv": ({}, "trains"),
    "lfm2": ({}, "trains"),
    "recurrent_gemma": ({}, STAGE_REFUSED),
    "falcon_h1": ({}, "trains"),
    "codegen": ({"rotary_dim": 4}, STAGE_REFUSED),
    "phi": ({}, STAGE_REFUSED),
    "ctrl": ({}, STAGE_REFUSED),
    "nanochat": ({}, STAGE_REFUSED),
    "falcon_mamba": ({}, "trains"),
    "mamba2": ({"num_heads": 8, "head_dim": 8, "n_groups": 1, "expand": 2}, "trains"),
    "gemma3n_text": ({"num_kv_shared_layers": 0}, STAGE_REFUSED),
    "gemma2": ({}, STAGE_REFUSED),
    "cohere2": ({}, STAGE_REFUSED),
    "zamba2": ({"layers_block_type": ["mamba", "hybrid"], "mamba_headdim": 8, "n_mamba_heads": 8}, STAGE_REFUSED),
    "mixtral": ({}, "refused"),
    "jamba": ({}, "refused"),
    "qwen3_next": ({}, "refused"),
}
FAST = list(TYPES)[:13]
# ~1.5 min of CI each on 2 cores (transformers' own forward of these hybrids is the cost): `-m exhaustive`
HEAVY = ("falcon_h1", "gemma3n_text")


# the types that generate by recomputing (their probe refuses the KV cache in one line); the rest decode through it
RECOMPUTE = ("openai-gpt", "mamba", "rwkv", "recurrent_gemma", "falcon_mamba", "mamba2", "zamba2", "falcon_h1")


def _outcome(tmp_path, model_type) -> str:
    """The training outcome (its kind checked by the caller), once the decoding one is the pinned one."""
    extra, kind = TYPES[model_type]
    got = sweep.outcome(sweep.write(tmp_path / model_type, model_type, **extra))
    if kind != "refused":
        assert got.decoding.split(":", 1)[0] == ("recomputes" if model_type in RECOMPUTE else "cached"), got
    return got.training


@pytest.mark.numeric
@pytest.mark.parametrize("model_type", FAST)
def test_the_findings_equal_transformers_or_are_refused_in_one_line(tmp_path, model_type):
    got = _outcome(tmp_path, model_type)
    assert got.split(":", 1)[0] == TYPES[model_type][1], got


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=pytest.mark.exhaustive) if t in HEAVY else t for t in list(TYPES)[13:]]
)
def test_each_type_equals_transformers_or_is_refused_in_one_line(tmp_path, model_type):
    got = _outcome(tmp_path, model_type)
    assert got.split(":", 1)[0] == TYPES[model_type][1], got


@pytest.mark.parametrize("model_type, extra", [("diffllama", {}), ("smollm3", {"num_hidden_layers": 4})])
def test_layers_that_differ_from_the_shared_function_keep_their_own(tmp_path, model_type, extra):
    """The probe finds the layer whose computation is not layer 0's; unchecked, the shared function differs."""
    template = hf.build_template(hf.load_config(sweep.write(tmp_path / model_type, model_type, **extra)))
    assert hf.check_stages(template) is False
    params = hf.init_params(template, rng.key(0))
    unchecked = hf.stages(template, share=True)  # the negative control: one function for every layer
    x = sweep.batches(1)[0][0]
    worst = 0.0
    with torch.no_grad():
        h = unchecked.embed.fn(unchecked.embed.params(params), x, None)
        for i, block in enumerate(unchecked.blocks):
            out = block.fn(block.params(params), h, None)
            alone = block.shared(block.own(params), h, None, torch.tensor(i))
            worst = max(worst, float((alone - out).abs().max() / out.abs().max()))
            h = out
    assert worst > 1e-4
    sweep.check_shared(template, params)  # the checked stages: each layer its own


def test_gpt2s_residual_projections_are_depth_scaled(tmp_path):
    """GPT-2's c_proj weights at std 0.02 / sqrt(2 n_layer), as transformers' own init (not 0.02)."""
    template = hf.build_template(
        hf.load_config(
            sweep.write(tmp_path / "gpt2", "gpt2", num_hidden_layers=8, hidden_size=64, intermediate_size=256)
        )
    )
    params = hf.init_params(template, rng.key(0))
    std = float(torch.cat([params[f"transformer.h.{i}.mlp.c_proj.weight"].flatten() for i in range(8)]).std())
    assert abs(std - 0.02 / 4.0) < 0.0005, std
    assert abs(float(params["transformer.h.0.mlp.c_fc.weight"].std()) - 0.02) < 0.002
