"""The decoder families' shared build checks: the model config from the run's keys, head counts against the
tensor-parallel size, the training length against a directory's positions, the tokenizer against the vocabulary."""

from __future__ import annotations

import ml_collections
import pytest

from functrain import config_checks
from functrain import data as data_lib
from functrain.models import decoder, lm_data
from functrain.models.gpt.model import GPTConfig
from functrain.models.llama.model import LlamaConfig


class _Ctx:
    """A parallel context as a mesh with `tp_world` tensor-parallel ranks gives (no mesh is made)."""

    def __init__(self, tp_world: int):
        self.tp_world = tp_world


def test_model_config_takes_every_field_the_keys_have_and_refuses_a_bad_invariant_in_one_line():
    keys = ml_collections.ConfigDict(
        {"name": "gpt", "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 16, "dropout": 0.1, "bias": False}
    )
    assert decoder.model_config(GPTConfig, keys, 300) == GPTConfig(300, 32, 2, 2, 16, 0.1, False)
    llama = ml_collections.ConfigDict({"block_size": 16, "n_layer": 1, "n_head": 4, "n_kv_head": 2, "n_embd": 32})
    cfg = decoder.model_config(LlamaConfig, llama, 64)
    assert (cfg.vocab_size, cfg.n_kv_head, cfg.head_dim, cfg.rope_theta) == (64, 2, 8, LlamaConfig.rope_theta)
    keys.n_head = 3
    with pytest.raises(config_checks.ConfigError, match=r"^model: n_embd=16 is not divisible by n_head=3.*\(--config"):
        decoder.model_config(GPTConfig, keys, 300)


def test_head_counts_the_tensor_parallel_size_does_not_divide_are_refused():
    decoder.check_heads(_Ctx(1), {"n_head": 3}, "fix")  # no tensor parallelism: any count
    decoder.check_heads(_Ctx(2), {"n_head": 4, "n_kv_head": 2}, "fix")
    decoder.check_heads(_Ctx(2), {"num_attention_heads": 4, "num_key_value_heads": 0}, "fix")  # 0: none
    with pytest.raises(
        config_checks.ConfigError,
        match=r"^n_head=4 and n_kv_head=1 must divide by the tensor-parallel size mesh.tp=2 .*; change mesh.tp$",
    ):
        decoder.check_heads(_Ctx(2), {"n_head": 4, "n_kv_head": 1}, "change mesh.tp")


def test_a_training_length_beyond_the_directory_positions_is_refused(tmp_path):
    decoder.check_length(64, 64, tmp_path / "config.json")
    decoder.check_length(4096, None, tmp_path / "config.json")  # the directory names no limit
    with pytest.raises(config_checks.ConfigError, match=r"model.block_size=65 exceeds .*config.json's 64 positions"):
        decoder.check_length(65, 64, tmp_path / "config.json")


def test_a_tokenizer_with_more_ids_than_the_model_is_refused():
    assert lm_data.check_vocab(None, 256, "fix") == 256  # bytes
    with pytest.raises(data_lib.DataError, match=r"^the byte tokenizer: the tokenizer has 256 ids but the model only"):
        lm_data.check_vocab(None, 100, "use the model's own tokenizer")


def test_a_model_vocabulary_smaller_than_the_data_is_refused():
    assert decoder.vocab_of(0, 50257) == 50257  # 0: the data's
    assert decoder.vocab_of(50304, 50257) == 50304  # padded up, as nanoGPT does
    with pytest.raises(config_checks.ConfigError, match=r"^model.vocab_size=100 is smaller than the data's vocabulary"):
        decoder.vocab_of(100, 256)
