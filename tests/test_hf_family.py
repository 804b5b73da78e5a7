"""The Hugging Face family: transformers causal LMs of several architectures, from tiny configs made here,
trained by functrain equal to the same model trained by a plain PyTorch loop, staged equal to whole,
exported to a directory transformers loads, weights read and written back bit for bit, resumed bit-exactly.

Losses are compared with tolerances from float32's epsilon and the reduction length (tests/_tol.py);
only losses (never parameters after AdamW steps: tests/_tol.py "Trajectories").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from _tol import assert_close, rtol

import functrain as ft
from functrain import config_checks, parallel, rng
from functrain import data as data_lib
from functrain.models import hf
from functrain.models.hf.tiny import write_tiny

transformers = pytest.importorskip("transformers")

import _hf_sweep as sweep  # noqa: E402  (it imports transformers)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, B, T, V = 20, 4, 16, 64
ARCHS = ["gpt2", "llama", "qwen2", "mistral", "gemma", "phi3", "qwen3", "olmo2", "opt"]
SHAPE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    head_dim=8,
)
NO_DROPOUT = {  # the torch loop's masks are torch's own (and OPT's layers are as wide as its embedding)
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": dict(dropout=0.0, attention_dropout=0.0, layerdrop=0.0, ffn_dim=64, word_embed_proj_dim=32),
}
# A loss is a mean over B*T tokens of logits over a width-32 model: ~B*T*V terms; 20 steps feed back.
TOL = rtol(B * T * V * 32) * STEPS


def _dir(tmp_path, arch, **extra):
    """A tiny `arch` model directory (config.json only)."""
    return write_tiny(tmp_path / arch, arch, **{**SHAPE, **NO_DROPOUT.get(arch, {}), **extra})


def _batches(n, seed=0):
    return sweep.batches(n, seed, shape=(B, T))


def _torch_loop(directory, params, data):
    """Losses of transformers' own module (our initial params loaded) trained by the plain loop."""
    return sweep.torch_loop(sweep.real_model(directory), params, data)


def _functrain(template, params, data, **kw):
    loss_fn = hf.make_loss_fn(template, **kw.pop("loss", {}))
    step = ft.make_train_step(loss_fn, sweep.optimizer(), **kw)
    state = ft.init_state(params, sweep.optimizer())
    losses = []
    for batch in data:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return losses


@pytest.mark.numeric
@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_trains_like_the_torch_loop_and_staged_like_whole(tmp_path, arch):
    directory = _dir(tmp_path, arch)
    template = hf.build_template(hf.load_config(directory))
    params = hf.init_params(template, rng.key(0))
    assert params.keys() == dict(template.named_parameters()).keys()
    data = _batches(STEPS)
    want = _torch_loop(directory, params, data)
    assert_close(torch.tensor(_functrain(template, params, data, compile=False)), torch.tensor(want), TOL)
    # the stages (a view of the base model per decoder layer), recomputed in the backward: the same losses
    staged = _functrain(template, params, data[:3], compile=False, loss={"remat": "full"})
    assert_close(torch.tensor(staged), torch.tensor(want[:3]), TOL)


@pytest.mark.slow
@pytest.mark.numeric
# gpt2 (learned positions, Conv1D) and llama (rotary, RMSNorm, grouped heads) in CI; qwen2 and gemma (the same
# kinds of layers, trained eagerly above) compiled too under `-m exhaustive` (~1 min of CI each)
@pytest.mark.parametrize(
    "arch", ["gpt2", "llama", *(pytest.param(a, marks=pytest.mark.exhaustive) for a in ("qwen2", "gemma"))]
)
def test_compiled_equals_the_torch_loop_with_no_recompiles(tmp_path, arch):
    from torch._dynamo.utils import counters

    directory = _dir(tmp_path, arch)
    template = hf.build_template(hf.load_config(directory))
    params = hf.init_params(template, rng.key(0))
    data = _batches(STEPS)
    torch._dynamo.reset()
    counters.clear()
    got = _functrain(template, params, data)
    # the loss and grads; per update group kind (the layers', the rest's) squared norms and update; the norm
    assert counters["stats"]["unique_graphs"] == 6 and not counters["recompiles"], dict(counters["recompiles"])
    assert_close(torch.tensor(got), torch.tensor(_torch_loop(directory, params, data)), TOL)


@pytest.mark.slow
@pytest.mark.numeric
def test_compiled_a_graph_per_stage_equals_the_torch_loop(tmp_path):
    """compile="blocks": the decoder layers (alike) share one compiled graph, with no recompile from layer to layer."""
    from torch._dynamo.utils import counters

    directory = _dir(tmp_path, "qwen2")
    template = hf.build_template(hf.load_config(directory))
    params = hf.init_params(template, rng.key(0))
    blocks = hf.stages(template).blocks
    assert blocks[0].shared is not None and all(b.shared is blocks[0].shared for b in blocks)
    data = _batches(STEPS)
    torch._dynamo.reset()
    counters.clear()
    got = _functrain(template, params, data, compile="blocks", loss={"staged": True})
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert_close(torch.tensor(got), torch.tensor(_torch_loop(directory, params, data)), TOL)


def test_init_is_a_function_of_the_key_and_where_gives_each_rank_its_block(tmp_path):
    template = hf.build_template(hf.load_config(_dir(tmp_path, "llama")))
    a, b, c = (hf.init_params(template, rng.key(s)) for s in (0, 0, 1))
    assert all(torch.equal(a[n], b[n]) for n in a) and not torch.equal(
        a["model.embed_tokens.weight"], c["model.embed_tokens.weight"]
    )
    norm = a["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))  # transformers' own init of an RMSNorm

    def where(name, shape):  # rank 1 of 2 along dim 0
        rows = -(-shape[0] // 2)
        return [rows] + [0] * (len(shape) - 1), [shape[0] - rows] + list(shape[1:])

    half = hf.init_params(template, rng.key(0), where=where)
    assert all(torch.equal(half[n], a[n][-(-a[n].shape[0] // 2) :]) for n in a)


def test_encoder_decoders_and_mixtures_of_experts_are_refused_in_one_line(tmp_path):
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps(transformers.T5Config(vocab_size=64, d_model=32).to_dict()))
    with pytest.raises(hf.HFModelError, match="t5 is an encoder-decoder; this family trains decoder-only"):
        hf.load_config(t5)
    moe = write_tiny(tmp_path / "moe", "mixtral", **SHAPE, num_local_experts=4)
    with pytest.raises(hf.HFModelError, match="mixtral is a mixture of experts"):
        hf.load_config(moe)
    with pytest.raises(hf.HFModelError, match="no such file"):
        hf.load_config(tmp_path / "nothing")


def test_what_the_stages_cannot_express_is_refused_in_one_line_and_trains_unstaged(tmp_path):
    gemma2 = _dir(tmp_path, "gemma2")  # logits soft-capped after the head
    template = hf.build_template(hf.load_config(gemma2))
    with pytest.raises(hf.HFModelError, match="more than hidden @ head.T .final_logit_softcapping"):
        hf.make_loss_fn(template, remat="full")
    params = hf.init_params(template, rng.key(0))
    data = _batches(3)
    assert_close(
        torch.tensor(_functrain(template, params, data, compile=False)),
        torch.tensor(_torch_loop(gemma2, params, data)),
        TOL,
    )
    opt = _dir(tmp_path, "opt", **{**NO_DROPOUT["opt"], "word_embed_proj_dim": 16})  # projections around the layers
    with pytest.raises(hf.HFModelError, match="holds project_out, project_in beside its embeddings"):
        hf.stages(hf.build_template(hf.load_config(opt)))


def _config(tmp_path, directory, **overrides):
    spec = importlib.util.spec_from_file_location("hf_config", os.path.join(REPO, "configs", "hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.model.path = str(directory)
    c.model.block_size = 16
    c.data.path = str(_text(tmp_path))
    c.compile = False
    for k, val in overrides.items():
        target = c
        *path, last = k.split(".")
        for p in path:
            target = target[p]
        target[last] = val
    return c


def _text(tmp_path):
    root = tmp_path / "text"
    if not root.exists():
        root.mkdir()
        for f in data_lib.stdlib_files()[:30]:
            (root / f.name).write_bytes(f.read_bytes())
    return root


def test_weights_read_from_a_directory_export_back_bit_for_bit_and_load_in_transformers(tmp_path):
    from safetensors.torch import load_file

    from functrain.models.hf import task

    torch.manual_seed(0)
    source = tmp_path / "saved"
    net = transformers.AutoModelForCausalLM.from_config(hf.load_config(_dir(tmp_path, "qwen2", vocab_size=256)))
    net.save_pretrained(source)
    with parallel.setup(None) as ctx:
        t = task.build(_config(tmp_path, source), ctx, tmp_path / "run")
        params = t.init_params(rng.key(0), torch.device("cpu"))
        out = t.export(params, tmp_path / "exported")
    theirs, ours = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[n], ours[n]) for n in theirs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=x).logits,
            ft.apply(hf.build_template(hf.load_config(source)), params, input_ids=x, train=False).logits,
            rtol=0,
            atol=0,
        )


def test_a_mesh_axis_or_plan_the_family_cannot_split_is_one_line(tmp_path):
    class Ctx:  # a context as a 2-rank cp mesh would give (no mesh is made)
        tp_world, cp_world, pp_world = 1, 2, 1

    with pytest.raises(config_checks.ConfigError, match="mesh.cp=2: the hf family .* has no context parallelism yet"):
        hf.refuse_axes(Ctx, "qwen2")
    for arch, why in (("gpt2", "has no tensor-parallel plan"), ("phi3", "colwise_gather_output")):
        with pytest.raises(hf.HFModelError, match=why):
            hf.tp_rules(hf.build_template(hf.load_config(_dir(tmp_path, arch))))


def _main(tmp_path, directory, workdir, *flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-m", "functrain.main", *_flags(tmp_path, directory, workdir), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [(r["step"], r["loss"]) for r in map(json.loads, open(workdir / "metrics.jsonl")) if "loss" in r]


def _flags(tmp_path, directory, workdir):
    return [
        "--config=configs/hf.py",
        f"--config.model.path={directory}",
        "--config.compile=False",
        "--config.model.block_size=16",
        f"--config.data.path={_text(tmp_path)}",
        "--config.batch_size=4",
        "--config.log_every=1",
        "--config.eval_every=100",
        "--config.eval_batches=1",
        "--config.sample.max_new_tokens=4",
        "--config.tensorboard=False",
        f"--workdir={workdir}",
    ]


@pytest.mark.slow
def test_a_killed_main_job_resumes_bit_exactly_and_its_exports_compute_its_logits(tmp_path):
    import signal
    import time

    from functrain import checkpoint as ckpt

    directory = _dir(tmp_path, "llama", vocab_size=256)
    steps = ["--config.steps=30", "--config.checkpoint.every=10"]
    whole = _main(tmp_path, directory, tmp_path / "whole", *steps)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.Popen(
        [sys.executable, "-m", "functrain.main", *_flags(tmp_path, directory, tmp_path / "cut"), *steps],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics, deadline = tmp_path / "cut" / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # killed once a checkpoint is behind it
        if (
            metrics.exists()
            and (tmp_path / "cut" / "checkpoints" / "10").exists()
            and sum(1 for _ in open(metrics)) >= 12
        ):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [json.loads(line)["step"] for line in open(metrics) if "loss" in line]
    assert 10 <= max(done) < 30, done  # killed midway, past the step-10 checkpoint
    resumed = _main(tmp_path, directory, tmp_path / "cut", *steps)
    last = {step: loss for step, loss in resumed}  # a step run twice (after the checkpoint, before the kill): its last
    assert sorted(last.items()) == whole and len(whole) == 30  # 1-10, then 11-30 from the checkpoint: the same bits

    params = ckpt.restore(str(tmp_path / "whole" / "checkpoints" / "30")).result()["params"]
    template = hf.build_template(hf.load_config(directory))
    x = torch.randint(0, 256, (2, 16))

    def logits_equal(exported, params):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
        with torch.no_grad():
            torch.testing.assert_close(
                loaded(input_ids=x).logits, ft.apply(template, params, input_ids=x, train=False).logits, rtol=0, atol=0
            )

    logits_equal(tmp_path / "whole" / "hf", params)  # the export at the end of the run
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functrain.main",
            *_flags(tmp_path, directory, tmp_path / "whole"),
            *steps,
            f"--export_hf={tmp_path / 'at20'}",
            f"--export_from={tmp_path / 'whole' / 'checkpoints' / '20'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "exported" in out.stdout, out.stderr[-3000:]
    logits_equal(tmp_path / "at20", ckpt.restore(str(tmp_path / "whole" / "checkpoints" / "20")).result()["params"])


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.parametrize("mesh", ["dp_shard", "tp", "pp"])
def test_two_ranks_match_one_process(tmp_path, mesh):
    """FSDP gathering a decoder layer at a time, tensor parallel by the model's plan (Qwen2: biased q/k/v), or
    two pipeline stages of one decoder layer each (4 microbatches, 1F1B; one process accumulates 4)."""
    import _tol

    directory = _dir(tmp_path, "qwen2", vocab_size=256)
    # SGD: the runs stay within rounding of each other (AdamW would not: tests/_tol.py "Trajectories").
    sgd = ["--config.steps=8", "--config.optim.name=sgd", "--config.optim.lr=0.05", "--config.checkpoint.every=100"]
    micro = {"pp": (["--config.accum_steps=4"], ["--config.pp.microbatches=4"])}.get(mesh, ([], []))
    one = _main(tmp_path, directory, tmp_path / "one", *sgd, *micro[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "functrain.main",
            "--config=configs/hf.py",
            f"--config.model.path={directory}",
            "--config.compile=False",
            "--config.model.block_size=16",
            f"--config.data.path={_text(tmp_path)}",
            "--config.batch_size=4",
            "--config.log_every=1",
            "--config.eval_every=100",
            "--config.eval_batches=1",
            "--config.sample.max_new_tokens=4",
            "--config.tensorboard=False",
            f"--config.mesh.{mesh}=2",
            "--config.dist_timeout_s=600",
            f"--workdir={tmp_path / 'two'}",
            *sgd,
            *micro[1],
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    two = [(r["step"], r["loss"]) for r in map(json.loads, open(tmp_path / "two" / "metrics.jsonl")) if "loss" in r]
    assert [s for s, _ in two] == list(range(1, 9))
    n = 4 * 16 * 256 * 128  # the batch's tokens through logits over 256 ids from a 128-wide model
    for i, ((_, a), (_, b)) in enumerate(zip(one, two)):
        drift = 1 + i * 2 * _tol.sgd_gain(0.05, 0.9)
        assert abs(b - a) <= _tol.rtol(n) * drift * a, (i, a, b)
    assert (f"'{mesh}': 2" if mesh != "pp" else "x pp=2 (1f1b, 4 microbatches)") in out.stdout


def test_a_missing_or_wrong_model_path_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    for flags, want in (
        ([], "functrain: error: model.path='' is out of range: a transformers model directory"),
        (
            [f"--config.model.path={tmp_path / 'nope'}"],
            f"functrain: error: model.path: {tmp_path / 'nope' / 'config.json'}: no such file",
        ),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "functrain.main", "--config=configs/hf.py", f"--workdir={tmp_path / 'run'}", *flags],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(want), out.stderr[-2000:]


@pytest.mark.parametrize("arch", ["bloom", "olmo", "gptj"])
def test_a_model_the_family_cannot_stage_samples_and_exports_on_one_process(tmp_path, arch):
    """The end of a run (sample, export) needs no stages on one process: no error, a sample and a directory whose
    logits transformers reproduces."""
    from functrain.models.hf import task
    from functrain.trainer import exports

    directory = _dir(tmp_path, arch, vocab_size=256, **({"rotary_dim": 4} if arch == "gptj" else {}))
    with pytest.raises(hf.HFModelError):  # (what the stages cannot express)
        hf.make_loss_fn(hf.build_template(hf.load_config(directory)), remat="full")
    with parallel.setup(None) as ctx:
        t = task.build(
            _config(tmp_path, directory, export_hf=True, **{"sample.max_new_tokens": 3}), ctx, tmp_path / "run"
        )
        params = t.init_params(rng.key(0), torch.device("cpu"))
        out = t.finish(params, rng.key(1))
        path, unchecked = exports.write(t, params, tmp_path / "run" / "hf")
    assert isinstance(out["sample"], str) and (path / "config.json").is_file() and unchecked is None


def test_a_model_whose_stages_fail_their_check_trains_unstaged_where_asked_only_by_default(tmp_path, capsys):
    """xglm's stages differ from its forward: remat=auto on a mesh falls back (one note), remat=full refuses."""
    from functrain.models.hf.loss import run_loss

    directory = _dir(tmp_path, "xglm", vocab_size=256)
    template = hf.build_template(hf.load_config(directory))

    class Mesh:  # a context as a 2-rank FSDP mesh gives (no mesh is made)
        mesh, tp_world, cp_world, pp_world, is_main_process = object(), 1, 1, 1, True

    loss_fn, staged = run_loss(_config(tmp_path, directory, remat="auto"), Mesh, template, template)
    assert not staged and "its stages composed differ" in capsys.readouterr().err
    with pytest.raises(
        config_checks.ConfigError,
        match="its stages composed differ from the base model's forward by .*; "
        "this family cannot stage it: train it with --config.remat=none$",
    ):
        run_loss(_config(tmp_path, directory, remat="full"), Mesh, template, template)
    with pytest.raises(
        config_checks.ConfigError, match="train it with --config.compile_unit=step$"
    ):  # the flag this run set
        run_loss(_config(tmp_path, directory, remat="auto", compile_unit="blocks"), Mesh, template, template)


def test_an_export_that_does_not_reproduce_the_model_is_one_line(tmp_path):
    """exports.verify loads the directory with transformers: the family's export passes; the same directory with
    a buffer or a config value it does not hold (what an export missing apertus's xIELU buffers did) fails in one
    line naming the difference."""
    import json as json_lib

    from functrain.interop.hf import HFError
    from functrain.models.hf import task
    from functrain.trainer import exports

    directory = _dir(tmp_path, "qwen2", vocab_size=256)
    with parallel.setup(None) as ctx:
        t = task.build(_config(tmp_path, directory, export_hf=True), ctx, tmp_path / "run")
        params = t.init_params(rng.key(0), torch.device("cpu"))
        path, unchecked = exports.write(t, params, tmp_path / "run" / "hf")
        assert unchecked is None
        config = json_lib.loads((path / "config.json").read_text())
        config["rms_norm_eps"] = 0.5  # what the model did not train with
        (path / "config.json").write_text(json_lib.dumps(config))
        with pytest.raises(HFError, match=r"transformers' logits of it differ from the run's by") as err:
            exports.verify(path, t.eval_model, params)
    assert "\n" not in str(err.value)
