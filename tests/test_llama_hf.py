"""Llama <-> Hugging Face: the real `transformers` LlamaForCausalLM on random tiny configs saved with
`save_pretrained` (no download), logits equal both ways; the task's init_from/export; bad directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from functrain import config_checks, parallel, rng
from functrain import data as data_lib
from functrain.interop.hf import HFDirectory, HFError, HFWeights, save_hf_directory
from functrain.models import llama

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.numeric

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATOL = 1e-5  # the bound on logits; measured: 0 (the same float32 ops in the same order)


def _hf_model(tmp_path, *, tied=False, kv=2, shard=None, vocab=300, name="hf", **extra):
    """A random LlamaForCausalLM saved with save_pretrained (optionally sharded); returns (dir, model)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
        **extra,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # make the norms non-trivial so a missed weight shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    out = tmp_path / name
    model.save_pretrained(str(out), **({"max_shard_size": shard} if shard else {}))
    return out, model


def _ours(directory):
    hf = HFDirectory(directory)
    cfg = llama.config_from_hf(hf.config, hf.path / "config.json")
    with torch.device("meta"):
        template = llama.Llama(cfg)
    return template, cfg, llama.load_hf_params(hf.weights, template)


def _ids(vocab, seed=0):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied,kv", [(False, 2), (True, 4), (False, 1)])
def test_hf_checkpoint_loads_and_computes_transformers_logits(tmp_path, tied, kv):
    directory, theirs = _hf_model(tmp_path, tied=tied, kv=kv)
    template, cfg, params = _ours(directory)
    assert cfg.tie_embeddings == tied and cfg.n_kv_head == kv and ("lm_head.weight" in params) == (not tied)
    x = _ids(cfg.vocab_size)
    with torch.no_grad():
        expected = theirs(x).logits
    torch.testing.assert_close(torch.func.functional_call(template, params, (x,)), expected, rtol=0, atol=ATOL)


def test_our_export_loads_in_transformers_with_the_same_logits(tmp_path):
    cfg = llama.LlamaConfig(
        vocab_size=120,
        block_size=40,
        n_layer=2,
        n_head=6,
        n_kv_head=2,
        n_embd=48,
        intermediate_size=72,
        rope_theta=500000.0,
        attention_bias=True,
    )
    with torch.device("meta"):
        template = llama.Llama(cfg)
    params = llama.init_params(template, rng.key(5))
    params = {n: t + 0.01 * torch.randn_like(t) if n.endswith("bias") else t for n, t in params.items()}
    out = save_hf_directory(tmp_path / "export", llama.export_hf_llama(params, cfg), llama.hf_llama_config(cfg))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    x = _ids(cfg.vocab_size, seed=1)
    with torch.no_grad():
        got = theirs(x).logits
    torch.testing.assert_close(got, torch.func.functional_call(template, params, (x,)), rtol=0, atol=ATOL)
    _, cfg2, back = _ours(out)  # and our reader gets the same tensors back
    assert cfg2 == cfg and all(torch.equal(back[n], params[n]) for n in params)


def test_sharded_checkpoint_reads_blocks_without_the_whole_tensor(tmp_path):
    directory, _ = _hf_model(tmp_path, shard="40KB")
    assert (directory / "model.safetensors.index.json").exists()
    weights = HFWeights(directory)
    name = "model.layers.1.mlp.down_proj.weight"  # (48, 80)
    whole = weights.read(name)
    torch.testing.assert_close(weights.read(name, (24, 10), (24, 30)), whole[24:48, 10:40], rtol=0, atol=0)
    template, cfg, params = _ours(directory)

    def where(n, shape):  # rank 1 of a 2-way row split
        half = shape[0] // 2
        return [half] + [0] * (len(shape) - 1), [shape[0] - half, *shape[1:]]

    blocks = llama.load_hf_params(weights, template, where=where)
    assert all(torch.equal(blocks[n], params[n][params[n].shape[0] // 2 :]) for n in params)


def test_bad_directories_name_the_file(tmp_path):
    directory, _ = _hf_model(tmp_path, shard="40KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (directory / shard).rename(directory / "moved")
    with pytest.raises(HFError, match=f"{shard}: shard named in model.safetensors.index.json is missing"):
        HFWeights(directory)

    single, _ = _hf_model(tmp_path, name="single")
    config = json.loads((single / "config.json").read_text())
    (single / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(HFError, match="model.safetensors: model.layers.0.mlp.gate_proj.weight has shape"):
        _ours(single)
    (single / "config.json").write_text(
        json.dumps({**config, "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    with pytest.raises(HFError, match="config.json: architecture \\['MistralForCausalLM'\\] is not supported"):
        _ours(single)
    (single / "config.json").write_text(
        json.dumps({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}})
    )
    with pytest.raises(HFError, match="config.json: rope scaling 'llama3' is not implemented"):
        _ours(single)
    (single / "config.json").unlink()
    with pytest.raises(HFError, match="config.json: missing"):
        HFDirectory(single)


def _text(tmp_path):
    """A small corpus: a few stdlib files (fast to tokenize)."""
    root = tmp_path / "text"
    if root.exists():
        return root
    root.mkdir()
    for f in data_lib.stdlib_files()[:40]:
        (root / f.name).write_bytes(f.read_bytes())
    return root


def _config(tmp_path, directory, **overrides):
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_config", os.path.join(REPO, "configs", "llama.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("tiny")
    c.init_from = f"hf:{directory}"
    c.data.path = str(_text(tmp_path))
    c.compile = False
    c.model.block_size = 32  # within the test model's 64 positions
    for k, val in overrides.items():
        target = c
        *path, last = k.split(".")
        for p in path:
            target = target[p]
        target[last] = val
    return c


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    directory, _ = _hf_model(tmp_path, vocab=260)
    tok = data_lib.train_bpe([p.read_text() for p in data_lib.stdlib_files()[:20]], 300, directory / "tokenizer.json")
    assert tok.vocab_size > 260
    with parallel.setup(None) as ctx, pytest.raises(data_lib.DataError, match="tokenizer.json: the tokenizer has"):
        from functrain.models.llama import task

        task.build(_config(tmp_path, directory), ctx, tmp_path / "run")


def test_a_directory_without_a_tokenizer_is_sized_from_its_model_or_refused_up_front(tmp_path):
    """data.tokenizer=auto, no tokenizer.json: a 256-id model gets bytes; any other is refused before a BPE is
    trained."""
    from functrain.models.llama import task

    byte_dir, _ = _hf_model(tmp_path, vocab=256, name="bytes")
    with parallel.setup(None) as ctx:
        t = task.build(_config(tmp_path, byte_dir), ctx, tmp_path / "run_bytes")
        x, _ = t.data.train_batch(0)
    assert (
        int(x.max()) < 256 and json.loads((tmp_path / "run_bytes" / "model.json").read_text())["tokenizer"] == "bytes"
    )
    assert not list((tmp_path / "run_bytes" / "data").glob("**/tokenizer*.json"))  # no BPE was trained

    other_dir, _ = _hf_model(tmp_path, vocab=300, name="bpe")
    with parallel.setup(None) as ctx, pytest.raises(config_checks.ConfigError) as info:
        task.build(_config(tmp_path, other_dir), ctx, tmp_path / "run_bpe")
    assert str(info.value) == (
        f"init_from: {other_dir} has no tokenizer.json and its model has 300 ids; give the model's tokenizer "
        "(--config.data.tokenizer=<path to tokenizer.json>) or train a new one of its size "
        "(--config.data.tokenizer=bpe:300)"
    )
    assert not (tmp_path / "run_bpe" / "data").exists()  # refused before any data was prepared


@pytest.mark.slow
def test_train_from_hf_export_at_the_end_and_from_a_checkpoint(tmp_path):
    """init_from=hf: trains from the directory's weights with its tokenizer; the end-of-run export and
    an export of an earlier checkpoint both load in transformers and compute our logits."""
    directory, theirs = _hf_model(tmp_path, vocab=320)
    tok = data_lib.train_bpe([p.read_text() for p in data_lib.stdlib_files()[:20]], 300, directory / "tokenizer.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    common = [
        "--config=configs/llama.py:tiny",
        f"--config.init_from=hf:{directory}",
        "--config.compile=False",
        "--config.model.block_size=32",
        f"--config.data.path={_text(tmp_path)}",
        "--config.steps=6",
        "--config.checkpoint.every=3",
        "--config.log_every=1",
        "--config.eval_every=6",
        "--config.eval_batches=1",
        "--config.sample.max_new_tokens=4",
        f"--workdir={tmp_path / 'run'}",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "functrain.main", *common],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"from hf:{directory}" in out.stdout and f"vocab 320 ({tok.name})" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if "loss" in r]
    # Step 1's loss is the Hugging Face model's own loss on that batch (same weights, same tokens).
    from functrain.models.llama import task as llama_task

    with parallel.setup(None) as ctx:
        t = llama_task.build(_config(tmp_path, directory), ctx, tmp_path / "probe")
        x, y = t.data.train_batch(0)
    with torch.no_grad():
        logits = theirs(x).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert abs(losses[0] - float(hf_loss)) <= 1e-5 * float(hf_loss)
    exported = tmp_path / "run" / "hf"
    assert (exported / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()

    from functrain import checkpoint as ckpt

    def check(hf_dir, step):
        params = ckpt.restore(str(tmp_path / "run" / "checkpoints" / str(step))).result()["params"]
        _, cfg, _ = _ours(directory)
        with torch.device("meta"):
            template = llama.Llama(cfg)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
        with torch.no_grad():
            torch.testing.assert_close(
                model(x).logits, torch.func.functional_call(template, params, (x,)), rtol=0, atol=ATOL
            )

    check(exported, 6)
    # the flags of a 2-rank run, exported by one process: the mesh only counts under torchrun
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functrain.main",
            *common,
            f"--export_hf={tmp_path / 'at3'}",
            f"--export_from={tmp_path / 'run' / 'checkpoints' / '3'}",
            "--config.mesh.dp_shard=2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "exported" in out.stdout, out.stderr[-3000:]
    check(tmp_path / "at3", 3)


def test_bad_hf_directory_is_one_error_line(tmp_path):
    directory, _ = _hf_model(tmp_path)
    (directory / "model.safetensors").unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functrain.main",
            "--config=configs/llama.py:tiny",
            f"--config.init_from=hf:{directory}",
            "--config.model.block_size=32",
            f"--workdir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("functrain: error: init_from: ") and str(directory) in lines[0]
    assert "no model.safetensors" in lines[0]


def test_an_export_onto_a_file_is_one_line_with_the_right_advice(tmp_path):
    """An existing file as the export path: the library and the command line say it is a file (not "free space")."""
    import importlib.util

    from functrain.trainer import main

    target = tmp_path / "taken"
    target.write_text("mine")
    with pytest.raises(HFError, match="is a file, not a directory; export to another path"):
        save_hf_directory(target, {"w": torch.zeros(2)}, {})
    spec = importlib.util.spec_from_file_location("llama_config", os.path.join(REPO, "configs", "llama.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(config_checks.ConfigError, match=r"taken is a file, and the export .* \(--export_hf=.*taken\)$"):
        main.export_hf(module.get_config("tiny"), tmp_path / "run", target)
    assert target.read_text() == "mine"  # nothing lost
    config = module.get_config("tiny")
    config.lora.rank = 4
    free, peft = tmp_path / "free", tmp_path / "free-peft"
    peft.write_text("mine")  # a LoRA export also writes <out>-peft: checked before anything is read
    with pytest.raises(config_checks.ConfigError, match=r"free-peft is a file, and the export"):
        main.export_hf(config, tmp_path / "run", free)
    assert peft.read_text() == "mine" and not free.exists()
