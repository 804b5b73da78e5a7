"""LoRA (`functrain.nn.lora`) against PEFT on the same numbers: the same losses and adapters after 20 AdamW
steps on tiny transformers models, the base never written, merged and PEFT exports giving functrain's logits."""

from __future__ import annotations

import copy
import json
import math
import re

import optree
import peft  # (the dev extra: the reference LoRA)
import pytest
import torch
import transformers
from _tol import adam_gain, assert_close, rtol, trajectory_atol

from functrain import init_state, optim
from functrain.nn import lora
from functrain.step import make_train_step

STEPS, LR, EPS, WD = 20, 1e-2, 1e-3, 0.01  # eps 1e-3: Adam's gain lr/eps bounded (tests/_tol.py)
B, T = 4, 16


def _tiny(model_type: str):
    """A tiny random transformers causal LM (fixed seed)."""
    from functrain.models.hf.tiny import TINY

    values = dict(TINY)
    if model_type == "gpt2":  # no dropout in the base: torch's draws and the step's keyed ones differ
        values.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = transformers.AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def _batches():
    """STEPS batches of learnable byte sequences (each id the previous one plus 7, from a random start)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (B, 1), generator=g) + 7 * torch.arange(T + 1)) % 256 for _ in range(STEPS)]


def _peft_run(base, targets, batches):
    """PEFT's model trained by torch.optim.AdamW: (its initial adapters by functrain's names, losses, adapters)."""
    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    model.train()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ours = {n.removeprefix(lora.PEFT_PREFIX).replace(".default.", "."): p for n, p in named.items()}
    initial = {n: p.detach().clone() for n, p in ours.items()}
    opt = torch.optim.AdamW(list(named.values()), lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return initial, losses, {n: p.detach().clone() for n, p in ours.items()}


def _functrain_run(base, spec, adapters, batches, compile=False):
    """functrain's step on the wrapped model: (losses, adapters, frozen base after, state)."""
    model = lora.wrap(base, spec)
    trained, frozen = lora.split({n: p.detach().clone() for n, p in model.named_parameters()})
    assert sorted(trained) == sorted(adapters)
    before = {n: v.clone() for n, v in frozen.items()}

    def loss_fn(params, ids, key):
        import functrain

        return functrain.apply(model, params, input_ids=ids[:, :-1], labels=ids[:, :-1]).loss, {}

    state = init_state(dict(adapters), optim.adamw(LR, eps=EPS, weight_decay=WD), frozen=frozen)
    step = make_train_step(loss_fn, optim.adamw(LR, eps=EPS, weight_decay=WD), compile=compile)
    losses = []
    for ids in batches:
        state, m = step(state, ids)
        losses.append(float(m["loss"]))
    return losses, state, before


@pytest.mark.parametrize(
    "model_type,targets",
    [("qwen2", ["q_proj", "v_proj"]), ("qwen2", "all-linear"), ("gpt2", ["c_attn"]), ("gpt2", "all-linear")],
)
def test_lora_trains_equal_to_peft(model_type, targets):
    """20 AdamW steps, r=8 alpha=16: the same losses and adapter weights as PEFT trained by torch.optim.AdamW;
    the frozen base bitwise as it was; its optimizer state holds the adapters only."""
    base = _tiny(model_type)
    batches = _batches()
    initial, peft_losses, peft_adapters = _peft_run(base, targets, batches)
    regex = targets if isinstance(targets, str) else "|".join(targets)
    spec = lora.LoraSpec(rank=8, alpha=16, targets=regex)
    losses, state, before = _functrain_run(base, spec, initial, batches)
    assert sorted(state.params) == sorted(peft_adapters)  # the same layers adapted as PEFT's
    n = T * 128
    assert_close(torch.tensor(losses), torch.tensor(peft_losses), rtol(n) * STEPS)
    scale = max(v.abs().max().item() for v in peft_adapters.values())
    atol = trajectory_atol(steps=STEPS, gain=adam_gain(LR, EPS), grad_scale=1.0, n=n)
    assert_close(state.params, peft_adapters, atol, absolute=True, msg=f"adapters (scale {scale:.3g})")
    assert losses[-1] < losses[0] - 0.05  # it trained
    assert all(torch.equal(state.frozen[k], before[k]) for k in before)  # the base: bitwise unchanged
    opt_names = {".".join(map(str, p)) for p in optree.tree_paths(state.opt_state)}
    assert not any(k in name for name in opt_names for k in before)  # no optimizer state for the base
    nbytes = lambda tree: sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree))  # noqa: E731
    assert nbytes(state.opt_state) <= 2 * nbytes(state.params) + 64  # Adam's two moments of the adapters, a count


def test_init_adapters_draw_pefts_distribution_and_a_fresh_adapter_changes_nothing():
    """A ~ U(±1/√in) (kaiming-uniform, a=√5), B = 0: the wrapped model's logits equal the base's exactly."""
    import functrain
    from functrain import rng

    base = _tiny("qwen2")
    spec = lora.LoraSpec(rank=8, alpha=16, targets="all-linear")
    model = lora.wrap(base, spec)
    adapters = lora.init_adapters(model, rng.key(0))
    for name, value in adapters.items():
        if name.endswith("lora_A.weight"):
            bound = 1.0 / math.sqrt(value.shape[1])
            assert value.abs().max() <= bound and value.abs().max() > 0.9 * bound
            assert abs(value.mean().item()) < 0.1 * bound
        else:
            assert not value.any()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    base_params = {n: p.detach() for n, p in base.named_parameters()}
    with torch.no_grad():
        want = base(input_ids=ids).logits
        got = functrain.apply(model, {**base_params, **adapters}, input_ids=ids).logits
    assert torch.equal(got, want)
    assert lora.init_adapters(model, rng.key(0)).keys() == adapters.keys()
    assert all(torch.equal(a, b) for a, b in zip(lora.init_adapters(model, rng.key(0)).values(), adapters.values()))


def test_targets_that_match_nothing_are_refused_in_one_line():
    """A regex naming no linear layer: one line listing the layers' names."""
    with pytest.raises(ValueError, match=r"matches no linear layer .*q_proj"):
        lora.wrap(_tiny("qwen2"), lora.LoraSpec(targets="query"))


def _gpt_lora(dropout: float, k: int = 4):
    """A tiny GPT base (drawn from key 0), its q/v-and-MLP adapters: (wrapped template, loss, base, K members)."""
    from functrain import rng
    from functrain.models import gpt

    cfg = gpt.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False, dropout=0.0)
    with torch.device("meta"):
        base_template = gpt.GPT(cfg)
    model = lora.wrap(base_template, lora.LoraSpec(rank=4, alpha=8, targets="all-linear", dropout=dropout))
    base = gpt.init_params(base_template, rng.key(0))
    opt = optim.adamw(1e-2, eps=EPS)
    lrs = [1e-2, 3e-3, 5e-3, 1e-2][:k]
    members = []
    for i, lr in enumerate(lrs):
        adapters = lora.init_adapters(model, rng.key(100 + i))
        members.append(optim.set_hyperparams(init_state(adapters, opt, seed=i, frozen=base), lr=lr))
    return cfg, model, gpt.make_loss_fn(model), opt, base, members


def test_a_population_of_adapters_over_one_base_equals_the_solo_runs():
    """K=4 adapter sets (other seeds and learning rates, adapter dropout from each member's key) trained by one
    vmapped step over one unstacked base: each member equal to its solo run over 20 steps; two members that
    differ only in their key draw other dropout masks."""
    from functrain import population

    cfg, model, loss_fn, opt, base, members = _gpt_lora(dropout=0.1)
    step = population.make_population_step(loss_fn, opt, compile=False, donate=False)
    solo = make_train_step(loss_fn, opt, compile=False, donate=False)
    pop = population.stack(members)
    assert all(pop.frozen[n] is base[n] for n in base)  # shared: no member dimension
    assert all(v.shape[0] == 4 for v in pop.params.values())
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
        batch = (x[:, :-1], x[:, 1:])
        pop, metrics = step(pop, batch)
        for i, m in enumerate(members):
            members[i], mm = solo(m, batch)
            assert torch.allclose(metrics["loss"][i], mm["loss"], rtol=rtol(8 * 32 * 32) * 20, atol=0)
    for i, m in enumerate(members):
        assert_close(population.member(pop, i).params, m.params, 1e-5, absolute=True, msg=f"member {i}")
    assert all(torch.equal(pop.frozen[n], base[n]) for n in base)

    twins = [members[0], members[0].replace(rng=members[3].rng)]  # the same adapters, other keys
    twin_pop, twin_metrics = step(population.stack(twins), batch)
    assert twin_metrics["loss"][0] != twin_metrics["loss"][1]  # dropout drawn from each member's key


@pytest.mark.slow
# the population step over a shared base compiled (~1.5 min of CI) under `-m exhaustive`; its plain compile:
# tests/test_population.py
@pytest.mark.parametrize("which", ["step", pytest.param("population", marks=pytest.mark.exhaustive)])
def test_compiled_lora_steps_are_one_graph_with_no_recompiles_and_equal_eager(which):
    """The LoRA step (adapter dropout from the key) and the population step over the shared base compile to one
    graph each and never recompile as the step, the learning rate and the members' numbers move; their losses equal
    the eager steps'."""
    from torch._dynamo.utils import counters

    from functrain import population

    cfg, model, loss_fn, opt, base, members = _gpt_lora(dropout=0.1)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randint(0, cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
        batches.append((x[:, :-1], x[:, 1:]))
    if which == "step":
        make, state = make_train_step, members[0]
    else:
        make, state = population.make_population_step, population.stack(members)
    torch._dynamo.reset()
    counters.clear()
    compiled, eager = (
        make(loss_fn, opt, compile=True, donate=False),
        make(loss_fn, opt, compile=False, donate=False),
    )
    a = b = state
    for batch in batches:
        a, ma = compiled(a, batch)
        b, mb = eager(b, batch)
        assert torch.allclose(ma["loss"], mb["loss"], rtol=rtol(8 * 32 * 32) * 4, atol=0), make.__name__
    # the population: one vmapped graph; the step: the loss and grads, the blocks' adapters' squared norms and update
    # (no other adapters), the norm
    graphs = 1 if make is population.make_population_step else 4
    assert counters["stats"]["unique_graphs"] == graphs, (make.__name__, dict(counters["stats"]))
    assert not counters["recompiles"], make.__name__
    assert all(torch.equal(a.frozen[n], base[n]) for n in base)


def test_a_staged_loss_reads_the_frozen_base_and_differentiates_the_adapters_only():
    """The GPT loss staged (every block recomputed in the backward) over a frozen base: the loss and the adapters'
    gradients of the plain loss, no gradient for the base; the per-block update groups hold adapters only."""
    from functrain import rng
    from functrain.models import gpt
    from functrain.step import update as update_lib
    from functrain.step import value_and_grad, with_frozen

    cfg, model, plain, opt, base, members = _gpt_lora(dropout=0.0, k=1)
    staged = gpt.make_loss_fn(model, remat="full")
    adapters = {n: v + 0.01 * rng.gaussian(rng.key(i), v.shape) for i, (n, v) in enumerate(members[0].params.items())}
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
    batch = (x[:, :-1], x[:, 1:])
    want_loss, _, want = value_and_grad(with_frozen(plain, base), adapters, batch, None)
    got_loss, _, got = value_and_grad(with_frozen(staged, base), adapters, batch, None)
    assert sorted(got) == sorted(adapters)
    assert_close(got_loss, want_loss, rtol(4 * 32 * 32))
    assert_close(got, want, rtol(4 * 32 * 32 * 4))
    groups, why = update_lib.plan_groups(adapters, staged.blocks, opt)
    assert not why and {n for g in groups for n in g.names} == set(adapters)


def test_llama_adapters_export_as_a_peft_directory_under_transformers_names(tmp_path):
    """The llama family's export of a LoRA run: the adapters under transformers' Llama names, which peft loads
    over the exported base, and the merged directory: both give functrain's logits."""
    import functrain
    from functrain import rng
    from functrain.interop.hf import save_hf_directory
    from functrain.models import lm_lora
    from functrain.models.llama import hf as hf_lib
    from functrain.models.llama import model as llama_lib

    cfg = llama_lib.LlamaConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    with torch.device("meta"):
        base_template = llama_lib.Llama(cfg)
    spec = lora.LoraSpec(rank=4, alpha=8, targets="q_proj|v_proj|up_proj")
    model = lora.wrap(base_template, spec)
    base = llama_lib.init_params(base_template, rng.key(0))
    adapters = {
        n: v + 0.02 * rng.gaussian(rng.key(i), v.shape)
        for i, (n, v) in enumerate(lora.init_adapters(model, rng.key(1)).items())
    }  # (B nonzero: a trained adapter)

    def export_base(params, out):
        return save_hf_directory(out, hf_lib.export_hf_llama(params, cfg), hf_lib.hf_llama_config(cfg))

    export_base(base, tmp_path / "base")
    export = lm_lora.exporter(export_base, model, spec, hf_name=hf_lib.hf_name, base_model=str(tmp_path / "base"))
    export({**base, **adapters}, tmp_path / "hf")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = functrain.apply(model, {**base, **adapters}, ids, train=False)
        plain = functrain.apply(base_template, base, ids, train=False)
        peft_model = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), str(tmp_path / "hf-peft")
        ).eval()
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        tol = rtol(64 * 8)
        assert (ours - plain).abs().max() > 100 * tol * ours.abs().max()  # the adapters change the logits
        assert_close(peft_model(input_ids=ids).logits, ours, tol, msg="peft")
        assert_close(merged(input_ids=ids).logits, ours, tol, msg="merged")
    config = json.loads((tmp_path / "hf-peft" / "adapter_config.json").read_text())
    assert r"model\.layers\.0\.self_attn\.q_proj" in config["target_modules"], config


def test_adapters_from_a_peft_directory_continue_as_peft_continues(tmp_path):
    """lora.init_from: adapters PEFT trained and saved (5 steps) are read by functrain's names, and 10 more AdamW
    steps from them equal PEFT's own 10 from `PeftModel.from_pretrained(..., is_trainable=True)`; a directory
    that does not fit the run is one line naming what to set."""
    from functrain.config_checks import ConfigError
    from functrain.models import lm_lora

    base = _tiny("qwen2")
    batches = _batches()
    _, _, trained = _peft_run(base, "all-linear", batches[:5])
    saved = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for n, p in saved.named_parameters():
            if p.requires_grad:
                p.copy_(trained[n.removeprefix(lora.PEFT_PREFIX).replace(".default.", ".")])
    saved.save_pretrained(tmp_path / "adapters")
    spec = lora.LoraSpec(rank=8, alpha=16, targets="all-linear")
    model = lora.wrap(base, spec)
    start = lm_lora.read_peft(str(tmp_path / "adapters"), model, spec, str, "")
    assert sorted(start) == sorted(trained) and all(torch.equal(start[n], trained[n]) for n in start)

    resumed = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapters", is_trainable=True)
    named = {n: p for n, p in resumed.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(named.values()), lr=LR, eps=EPS, weight_decay=WD)
    peft_losses = []
    for ids in batches[5:15]:
        loss = resumed(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        peft_losses.append(loss.item())
    losses, state, _ = _functrain_run(base, spec, start, batches[5:15])
    assert_close(torch.tensor(losses), torch.tensor(peft_losses), rtol(T * 128) * 10)
    ours = {
        lora.PEFT_PREFIX + n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
        for n, v in state.params.items()
    }
    atol = trajectory_atol(steps=10, gain=adam_gain(LR, EPS), grad_scale=1.0, n=T * 128)
    assert_close(ours, {n: p.detach() for n, p in named.items()}, atol, absolute=True, msg="adapters")

    for bad, says in (
        (lora.LoraSpec(rank=4, alpha=16, targets="all-linear"), "r 8 (set --config.lora.rank=8)"),
        (lora.LoraSpec(rank=8, alpha=32, targets="all-linear"), "lora_alpha 16 (set --config.lora.alpha=16)"),
        (lora.LoraSpec(rank=8, alpha=16, targets="q_proj|v_proj"), "set --config.lora.targets"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)) as err:
            lm_lora.read_peft(str(tmp_path / "adapters"), lora.wrap(base, bad), bad, str, "")
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="reads no PEFT directory"):
        lm_lora.read_peft(str(tmp_path / "adapters"), model, spec, None, "")


def test_all_linear_leaves_out_what_get_output_embeddings_names_as_peft(tmp_path):
    """ "all-linear" picks PEFT's layers (every Linear/Conv1D but `get_output_embeddings()`) on 15 causal types, and on
    a model whose output layer is named like no head while an inner layer is called `output`."""
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    from functrain.models.hf.tiny import TINY

    kinds = ["gpt2", "llama", "qwen2", "mistral", "gemma", "phi3", "qwen3", "opt", "falcon", "gpt_neox", "gptj"]
    kinds += ["bloom", "mpt", "stablelm", "starcoder2"]
    for kind in kinds:
        config = transformers.AutoConfig.for_model(kind, **TINY)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        cfg = peft.LoraConfig(target_modules="all-linear", task_type="CAUSAL_LM")
        want = _maybe_include_all_linear_layers(cfg, model).target_modules
        assert set(lora.targets_of(model, lora.LoraSpec(targets="all-linear"))) == set(want), kind

    class Odd(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.output = torch.nn.Linear(8, 8)  # an inner layer named like a head: adapted
            self.to_vocab = torch.nn.Linear(8, 32)  # the head: left out

        def get_output_embeddings(self):
            return self.to_vocab

    odd = Odd(transformers.PretrainedConfig())
    want = _maybe_include_all_linear_layers(peft.LoraConfig(target_modules="all-linear"), odd).target_modules
    assert set(lora.targets_of(odd, lora.LoraSpec(targets="all-linear"))) == set(want) == {"output"}


def test_alpha_must_be_positive_and_merge_is_pefts_in_float64():
    with pytest.raises(ValueError, match=r"lora.alpha must be > 0"):
        lora.LoraSpec(alpha=0)
    base = _tiny("qwen2").double()
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    ref = peft.get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(generator=torch.Generator().manual_seed(len(n)))
    params = {
        n.removeprefix(lora.PEFT_PREFIX).replace(".default.", ".").replace(".base_layer.", "."): p.detach()
        for n, p in ref.named_parameters()
    }
    spec = lora.LoraSpec(rank=8, alpha=16, targets="all-linear")
    merged = lora.merge(lora.wrap(base, spec), params)
    theirs = {n: p.detach() for n, p in ref.merge_and_unload().named_parameters()}
    assert all(merged[n].dtype == torch.float64 for n in merged)
    assert all(torch.equal(merged[n], theirs[n]) for n in theirs), max(
        (merged[n] - theirs[n]).abs().max().item() for n in theirs
    )
