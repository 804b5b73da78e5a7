"""Tokenizer directories shaped as Qwen2.5-Instruct, Llama-3-Instruct and DeepSeek-V3 ship them: a byte-level
BPE trained here (tokenizers) carrying their special tokens and post-processor, their tokenizer_config.json
(special tokens, add_bos_token, tokenizer_class, the chat template) and generation_config.json (eos ids).
The chat templates are the ones TRL carries (trl/chat_templates: the models' own, and the `*_training`
variants with `{% generation %}` blocks).
"""

from __future__ import annotations

import json
from pathlib import Path

STYLES = ("qwen2.5", "llama3", "deepseek")

_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. What does json.dumps do? It serializes an object.\n",
    "You are a helpful assistant. 2+2=4, 17+25=42; hello there, how are you today?\n",
]

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_SPECIALS = {
    "qwen2.5": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>"]
    + ["<|eot_id|>"],
    "deepseek": [B, E, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
}
_TEMPLATES = {"qwen2.5": "qwen2_5", "llama3": "llama3", "deepseek": "deepseekv3"}


def trl_template(style: str, training: bool = False) -> str:
    """The chat template TRL ships for `style` (`training`: the variant with `{% generation %}` blocks)."""
    import trl

    name = _TEMPLATES[style] + ("_training" if training else "")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


# The models' own pre-tokenizer splits (their tokenizer.json; transformers' Qwen2Tokenizer sets Qwen's itself)
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLIT = {
    "qwen2.5": [_WORDS + r"\p{N}|" + _REST],
    "llama3": [_WORDS + r"\p{N}{1,3}|" + _REST],
    "deepseek": [
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ],
}


def _tokenizer(style: str, specials: list[str], bos: str | None):
    """A byte-level BPE of ~400 ids with `specials` added, the style's pre-tokenizer split, and BOS added by its
    post-processor when given."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in _SPLIT[style]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_TEXT * 40, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None:
        tok.post_processor = byte_level
    else:  # Llama-3's and DeepSeek's: BOS before every text
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    return tok


def _added(token: str) -> dict:
    """A tokenizer_config.json AddedToken entry (DeepSeek writes them so)."""
    return {"__type": "AddedToken", "content": token, "lstrip": False, "normalized": True, "rstrip": False}


def write(directory, style: str, *, training: bool = False, config: bool = True) -> Path:
    """Writes a `style` tokenizer directory; returns it.

    Args:
      directory: where (created).
      style: one of `STYLES`.
      training: the template with `{% generation %}` blocks.
      config: False writes tokenizer.json alone (a bare vocabulary: no tokenizer_config/generation_config).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    specials = _SPECIALS[style]
    tok = _tokenizer(style, specials, bos={"llama3": "<|begin_of_text|>", "deepseek": B}.get(style))
    tok.save(str(d / "tokenizer.json"))
    if not config:
        return d
    ids = tok.token_to_id
    template = trl_template(style, training)
    if style == "qwen2.5":
        cfg = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": template,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        gen = {"bos_token_id": ids("<|endoftext|>"), "pad_token_id": ids("<|endoftext|>")}
        gen["eos_token_id"] = [ids("<|im_end|>"), ids("<|endoftext|>")]
    elif style == "llama3":
        cfg = {
            "bos_token": "<|begin_of_text|>",
            "chat_template": template,
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 1000000000000000019884624838656,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        gen = {"bos_token_id": ids("<|begin_of_text|>")}
        gen["eos_token_id"] = [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")]
    else:
        cfg = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": _added(B),
            "clean_up_tokenization_spaces": False,
            "eos_token": _added(E),
            "legacy": True,
            "model_max_length": 131072,
            "pad_token": _added(E),
            "sp_model_kwargs": {},
            "unk_token": None,
            "tokenizer_class": "LlamaTokenizerFast",
            "chat_template": template,
        }
        gen = {"bos_token_id": ids(B), "eos_token_id": ids(E)}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (d / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True}, indent=2))
    return d
