"""One builder for every decoder-only family: a family states its model as a `ModelSpec` (torchtitan's
`ModelSpec`), and `task` makes the run's `Task` from it and the run's data: the LoRA adapters, the
sharding, the loss, the end-of-run sample, the export, the evaluation model.

Example:
    >>> spec = ModelSpec(base=template, tp_rules=lambda t: gpt.TP_RULES, stages=gpt.stages,
    ...                  head=lambda t: "wte.weight", init_params=init, export=export)
    >>> task = decoder.task(config, ctx, workdir, spec, dataset, Facts("GPT 0.84M params", 256, flops))
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from functrain import config_checks, functional, generation, grpo, parallel, preference, rng
from functrain.interop.hf import HFDirectory, HFError
from functrain.models import inference, lm, lm_data, lm_grpo, lm_lora, lm_preference
from functrain.models import stages as stages_lib
from functrain.task import Task

__all__ = [
    "Built",
    "Facts",
    "ModelSpec",
    "check_heads",
    "check_length",
    "init_or_read",
    "model_config",
    "open_directory",
    "task",
    "vocab_of",
]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a decoder family brings to the one builder.

    Attributes:
      base: the model on the meta device (shapes only: the state holds the real tensors).
      tp_rules: `template -> rules` for `parallel.default_rules` (the template carries the run's adapters).
      stages: `model -> stages_lib.LMStages` (embedding, blocks, head) for the staged loss, sharded sampling and
        evaluation.
      head: `template -> the output projection's weight name` (the template carries the run's adapters).
      init_params: `(key, device, where=None) -> params` of the base: fresh, or a directory's weights.
      export: `(params, out)` writing a directory transformers loads, or None.
      hf_name: a param's name in the transformers model (LoRA's PEFT files), or None where the layers differ.
      base_model: the directory of the base's weights ("" when fresh), for PEFT's adapter config.
    """

    base: nn.Module
    tp_rules: Callable[[nn.Module], Any]
    stages: Callable[[Any], stages_lib.LMStages]
    head: Callable[[nn.Module], str]
    init_params: Callable
    export: Callable | None
    hf_name: Callable[[str], str] | None = None
    base_model: str = ""


class Facts(NamedTuple):
    """What the run reports of its model: the summary line, the trained length, FLOPs, `<workdir>/model.json`."""

    describe: str
    seq: int
    flops_per_token: float
    info: dict | None = None


class Built(NamedTuple):
    """A family's own model and loss where the builder's defaults do not fit (the hf family's)."""

    model: nn.Module  # the copy the loss runs (tensor-parallel)
    loss_fn: Callable
    stages: stages_lib.LMStages | None  # None: the loss is not staged (sampling and evaluation gather the whole model)
    logits_fn: Callable | None = None  # `(params, idx) -> logits` where the model's forward is not the stages'
    window: int | None = None  # the sample's context (None: the model's `cfg.block_size`)
    cached: generation.CachedModel | None = None  # the model through a KV cache (None: generation recomputes)


def task(
    config: Any,
    ctx: parallel.ParallelContext,
    workdir: str | Path,
    spec: ModelSpec,
    dataset: Any,
    facts: Facts,
    build: Callable[[nn.Module, Any], Built] | None = None,
) -> Task:
    """The run's `Task` for a decoder family.

    Args:
      config: the run config.
      ctx: the parallel context.
      workdir: the run directory (`model.json` is written there when `facts.info`).
      spec: the family's `ModelSpec`.
      dataset: the run's data (`functrain.data.run_data`).
      facts: the summary line, trained length, FLOPs per token and `model.json`'s contents.
      build: `(template, rules) -> Built`, the family's own model copies and loss (None: the context- and
        tensor-parallel copies and `lm.make_lm_loss_fn` over `spec.stages`).

    Returns:
      The `Task`.

    Example:
      >>> task = decoder.task(config, ctx, "runs/gpt", spec, dataset, Facts("GPT", 256, 6e6))
    """
    template, lora_spec = lm_lora.wrap(spec.base, config, ctx)  # with adapters under --config.lora.rank
    rules = parallel.adapter_rules(template, parallel.default_rules(spec.tp_rules(template)))
    lm_data.check_packing(config, ctx)
    head = spec.head(template)
    built = (build or _default_build(config, ctx, spec, facts.seq, head))(template, rules)
    if ctx.is_main_process and facts.info is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        (Path(workdir) / "model.json").write_text(json.dumps(facts.info, indent=2, default=str) + "\n")
    init = lm_lora.with_adapters(
        spec.init_params, template, lora_spec, init_from=config.lora.init_from, hf_name=spec.hf_name,
        base_model=spec.base_model,
    )  # fmt: skip
    loss_fn, count, frozen = built.loss_fn, lm.count_targets(), lm_lora.frozen(lora_spec)
    logits = built.logits_fn or (lambda p, x: functional.apply(built.model, p, x, train=False))
    how = lm_preference.objective_of(config, ctx, dataset)
    rl = lm_grpo.objective_of(config, ctx, dataset)
    if rl is not None:  # prompts: each step's batch a rollout of the policy, the GRPO loss over it
        dataset, count = _rollouts(config, ctx, workdir, dataset, built), grpo.count_for(rl)
        if rl.beta and lora_spec is None:  # a frozen copy of the starting params beside them
            init, frozen = lm_preference.init_with_reference(init), preference.is_reference
        ref = preference.adapters_off if lora_spec is not None else preference.reference_of  # (LoRA: the base)
        loss_fn = grpo.make_loss_fn(lambda p, x, key: logits(p, x), rl, reference=ref if rl.beta else None)
    if how is not None:  # chosen/rejected pairs: the preference loss, counted in pairs, beside a reference
        reference = "adapters_off" if lora_spec is not None else "copy"  # (LoRA: the base, no second copy)
        if config.preference.precompute_reference:  # the log-probs once, into the batches
            reference, place = "precomputed", lm_data.placement(config, ctx, workdir)
            dataset = lm_preference.with_reference_logps(
                dataset, init, logits, lora_spec is not None, key=rng.key(config.seed), device=ctx.device,
                cache_dir=place.cache_dir, log=place.log,
            )  # fmt: skip
        elif lora_spec is None:
            init, frozen = lm_preference.init_with_reference(init), preference.is_reference
        loss_fn, count = lm_preference.loss_fn(how, logits, reference), preference.count_pairs()
    return Task(
        describe=f"{facts.describe}, {dataset.describe()}",
        init_params=init,
        shard_rules=rules,
        loss_fn=loss_fn,
        data=dataset,
        count_targets=count,
        tokens_per_step=lm_grpo.row_tokens(config)
        if rl is not None
        else lambda batch: config.batch_size * batch[0][0].numel(),
        flops_per_token=lm_lora.flops_per_token(facts.flops_per_token, template, lora_spec),
        finish=_sampler(config, ctx, dataset, template, head, built),
        export=lm_lora.exporter(spec.export, template, lora_spec, hf_name=spec.hf_name, base_model=spec.base_model),
        frozen=frozen,
        eval_model=inference.eval_model(
            template,
            dataset.tokenizer,
            block_size=facts.seq,
            stages=built.stages,
            head=head,
            logits_fn=built.logits_fn,
            cached=built.cached,
        ),
    )


def _rollouts(config, ctx, workdir, prompts, built: Built) -> lm_grpo.Rollouts:
    """A GRPO run's data: rollouts of the prompts sampled through the family's KV cache."""
    if built.cached is None:
        raise config_checks.ConfigError(
            "GRPO samples its completions through a KV cache, and this model has none (functrain.generation); "
            "train a family that has one (hf, gpt, llama)"
        )
    sampler = lm_grpo.Sampler.of(config, built.cached, prompts.tokenizer, ctx)
    key = rng.fold_in(rng.key(config.seed), 1)  # the rollouts' stream (the init draws from the seed's own)
    return lm_grpo.Rollouts(prompts, sampler, lm_grpo.rewards_of(config), key=key, workdir=workdir, device=ctx.device)


def open_directory(path: str | Path, key: str, *, weights: bool = True) -> tuple[HFDirectory, Any]:
    """A transformers model directory and its weights, opened now: a missing shard fails before anything else.

    Args:
      path: the directory.
      key: the config key that named it (the refusal's first word).
      weights: open its safetensors (False: a fresh model over its config).

    Returns:
      `(HFDirectory, weights or None)`.

    Raises:
      ConfigError: an unusable directory (one line naming the file).

    Example:
      >>> directory, weights = decoder.open_directory("SmolLM-135M", "init_from")
    """
    try:
        directory = HFDirectory(path)
        return directory, directory.weights if weights else None
    except HFError as exc:
        raise config_checks.ConfigError(f"{key}: {exc}") from None


def init_or_read(base: nn.Module, weights: Any, fresh: Callable, read: Callable | None = None) -> Callable:
    """A `ModelSpec.init_params`: `read(weights, base, ...)` where there are weights, else `fresh(base, key, ...)`.

    Args:
      base: the family's model on the meta device.
      weights: a directory's opened weights (`open_directory`), or None.
      fresh: `(base, key, device=, where=) -> params` from the run's key.
      read: `(weights, base, device=, where=) -> params` (only this rank's block of each with `where`).

    Returns:
      `init_params(key, device, where=None) -> params`.

    Example:
      >>> init = decoder.init_or_read(base, weights, llama.init_params, llama_hf.load_hf_params)
    """

    def init_params(key, device, where=None):
        if weights is None or read is None:
            return fresh(base, key, device=device, where=where)
        return read(weights, base, device=device, where=where)

    return init_params


def model_config(cls: type, keys: Any, vocab: int) -> Any:
    """A family's model config dataclass from the run's `model.*` keys (every field the keys have), with `vocab` ids.

    Args:
      cls: the dataclass (e.g. `GPTConfig`); its `__post_init__` checks its own invariants.
      keys: `config.model`.
      vocab: the vocabulary size.

    Returns:
      `cls(vocab_size=vocab, **the keys named as its fields)`.

    Raises:
      ConfigError: an invariant the dataclass refuses (its ValueError, as one line).

    Example:
      >>> cfg = decoder.model_config(GPTConfig, config.model, vocab=256)
    """
    fields = {f.name: keys[f.name] for f in dataclasses.fields(cls) if f.name != "vocab_size" and f.name in keys}
    try:
        return cls(vocab_size=vocab, **fields)
    except ValueError as exc:
        raise config_checks.ConfigError(f"model: {exc} (--config.model.*)") from None


def vocab_of(model_vocab: int, data_vocab: int) -> int:
    """A model's vocabulary over data of `data_vocab` ids: `model_vocab`, or the data's when 0.

    Raises:
      ConfigError: `model_vocab` is smaller than the data's (its ids would index past the embedding).

    Example:
      >>> cfg = decoder.model_config(GPTConfig, config.model, decoder.vocab_of(config.model.vocab_size, 50257))
    """
    if model_vocab and model_vocab < data_vocab:
        raise config_checks.ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the data's vocabulary ({data_vocab}); set "
            "model.vocab_size=0 to take it from the data (--config.model.vocab_size)"
        )
    return model_vocab or data_vocab


def check_heads(ctx: parallel.ParallelContext, heads: dict[str, int], fix: str) -> None:
    """Refuses, in one line, head counts the tensor-parallel size does not divide (each rank computes whole heads).

    Args:
      ctx: the parallel context (`tp_world`).
      heads: {what: count}, e.g. {"n_head": 12, "n_kv_head": 4} (a count of 0: the model has none).
      fix: what to change, e.g. "change --config.model.n_head or --config.mesh.tp".

    Example:
      >>> decoder.check_heads(ctx, {"n_head": cfg.n_head}, "change --config.model.n_head or --config.mesh.tp")
    """
    if ctx.tp_world > 1 and any(n % ctx.tp_world for n in heads.values() if n):
        counts = " and ".join(f"{k}={n}" for k, n in heads.items())
        raise config_checks.ConfigError(
            f"{counts} must divide by the tensor-parallel size mesh.tp={ctx.tp_world} (each rank computes whole "
            f"heads); {fix}"
        )


def check_length(seq: int, longest: int | None, config_json: Path) -> None:
    """Refuses, in one line, a training length `seq` beyond the `longest` positions a model directory's
    `config_json` gives (None: it names none).

    Example:
      >>> decoder.check_length(config.model.block_size, hf_config.max_position_embeddings, path / "config.json")
    """
    if longest and seq > longest:
        raise config_checks.ConfigError(
            f"model.block_size={seq} exceeds {config_json}'s {longest} positions; lower --config.model.block_size"
        )


def _default_build(config, ctx, spec: ModelSpec, seq: int, head: str) -> Callable:
    """`build(template, rules)`: the context-parallel copy (this rank's tokens), then the tensor-parallel one, and
    the family's staged loss (stages where the run shards, recomputes or pipelines)."""

    def build(template: nn.Module, rules) -> Built:
        model = stages_lib.context_model(template, ctx, seq, config.cp_attention)
        model = parallel.tensor_parallel(model, ctx.mesh, rules)
        # sharded: staged, so each block is gathered just before it runs; "auto" recomputes the blocks on
        # a mesh so their gathered params go after the forward (never the whole model), none on 1 process
        loss_fn = lm.make_lm_loss_fn(
            model,
            spec.stages(model),
            head=head,
            chunk_size=config.loss_chunk_size,
            remat=stages_lib.resolve_remat(config.remat, ctx.mesh),
            staged=stages_lib.wants_stages(config, ctx),
        )
        st = spec.stages(template)
        # tensor-parallel params decode on this rank's heads (the training plan, without the cp split)
        tp = spec.stages(parallel.tensor_parallel(template, ctx.mesh, rules)) if ctx.tp_world > 1 else None
        return Built(model, loss_fn, st, cached=inference.cached_model(template, st, head, tp, ctx.tp_world))

    return build


def _sampler(config, ctx, dataset, template: nn.Module, head: str, built: Built) -> Callable:
    """`finish(params, key)`: a text sample from the prompt (or the answer to a held-out prompt), drawn from `key`
    through the family's KV cache (`built.cached`, eager: one sample is not worth a compile; sharded params a
    stage gathered at a time, on a tp axis each rank's own heads), else recomputed (gathered a stage at a time,
    or whole where the loss is not staged); the same draws either way."""
    sample = config.sample
    how = generation.Sampling(sample.temperature, sample.top_k or 0)

    def finish(params, key):
        cached, sharded = built.cached, any(parallel.is_dtensor(t) for t in params.values())
        if sharded and built.stages is None and (cached is None or cached.sharded_forward is None):
            params, sharded = parallel.gather(params), False  # unstaged: each step gathers the whole model anyway

        def generate(prompt, n: int):
            length = prompt.shape[1] + n - 1  # the cache's slots: this sample's, not the model's whole block
            room = cached is not None and 0 < n and length <= min(built.window or length, cached.block_size)
            if cached is not None and room and (cached.sharded_forward is not None or not sharded):
                gen = generation.Generator(cached, block_size=length, batch_size=1, compile=False)
                [[done]] = gen(params, prompt.tolist(), n, key=key, sampling=how)
                return torch.cat([prompt, torch.tensor([done.tokens], dtype=prompt.dtype, device=prompt.device)], 1)
            return inference.generate(
                template,
                parallel.gather(params) if sharded and built.stages is None else params,
                prompt,
                n,
                temperature=sample.temperature,
                top_k=sample.top_k or None,
                key=key,
                stages=built.stages,
                head=head,
                block_size=built.window,
                logits_fn=built.logits_fn,
            )

        return lm_data.finish_text(dataset, sample, generate, ctx.device)

    return finish
