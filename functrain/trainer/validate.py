"""The trainer's own config checks: the loop's keys (`LOOP_CHECKS`) and CUDA graphs' needs (the check helpers
and `ConfigError` are `functrain.config_checks`').

Example:
    >>> config_checks.check_all(config, validate.LOOP_CHECKS)
"""

from __future__ import annotations

from typing import Any

from functrain.config_checks import (
    Check,
    ConfigError,
    boolean,
    int_at_least,
    number_at_least,
    number_in,
    one_of,
)

__all__ = ["LOOP_CHECKS", "check_cuda_graphs"]


def check_cuda_graphs(config: Any, device_type: str | None = None) -> None:
    """Raises `ConfigError` when `config.cuda_graphs` is asked for where it cannot work.

    Args:
      config: the run config (reads cuda_graphs, compile, compile_unit).
      device_type: the run's device type, once known ("cuda", "cpu", ...); None skips that check.

    Returns:
      None.

    Example:
      >>> check_cuda_graphs(config, "cuda")
    """
    if not config.cuda_graphs:
        return
    if not config.compile:
        raise ConfigError(
            "cuda_graphs=True records the compiled step: it needs compile=True "
            "(set --config.compile=True or drop --config.cuda_graphs)"
        )
    if config.compile_unit != "step":
        raise ConfigError(
            f"cuda_graphs=True records the one-graph step: it needs compile_unit='step', not "
            f"{config.compile_unit!r} (set --config.compile_unit=step or drop --config.cuda_graphs)"
        )
    if device_type is not None and device_type != "cuda":
        raise ConfigError(
            f"cuda_graphs=True needs a CUDA device; this run's device is {device_type} (drop --config.cuda_graphs)"
        )


LOOP_CHECKS: list[Check] = [
    ("steps", int_at_least(1)),
    ("epochs", number_at_least(0.0)),
    ("stop_at", int_at_least(0)),
    ("batch_size", int_at_least(1)),
    ("accum_steps", int_at_least(1)),
    ("log_every", int_at_least(1)),
    ("eval_every", int_at_least(1)),
    ("eval_batches", int_at_least(1)),
    ("eval.limit", int_at_least(0)),
    ("eval.batch_size", int_at_least(1)),
    ("eval.truncate", boolean()),
    ("eval.compile", boolean()),
    ("eval.mean_token", one_of("nanogpt", "harness")),
    ("lora.rank", int_at_least(0)),
    ("lora.alpha", number_at_least(0.0, strict=True)),
    ("lora.dropout", number_in(0.0, 0.99)),
    ("lora.rslora", boolean()),
    ("preference.loss", one_of("sigmoid", "ipo", "hinge")),  # (`preference.LOSSES`: checked before torch loads)
    ("preference.beta", number_at_least(0.0, strict=True)),
    ("preference.label_smoothing", number_in(0.0, 0.5)),
    ("preference.precompute_reference", boolean()),
    ("grpo.num_generations", int_at_least(1)),
    ("grpo.max_new_tokens", int_at_least(1)),
    ("grpo.temperature", number_at_least(0.0, strict=True)),
    ("grpo.top_k", int_at_least(0)),
    ("grpo.loss", one_of("dapo", "grpo", "dr_grpo", "bnpo")),  # (`grpo.LOSSES`: checked before torch loads)
    ("grpo.beta", number_at_least(0.0)),
    ("grpo.epsilon", number_in(0.0, 1.0)),
    ("grpo.epsilon_high", number_at_least(0.0)),
    ("grpo.scale_rewards", one_of("group", "batch", "none")),
    ("grpo.num_iterations", int_at_least(1)),
    ("grpo.mask_truncated", boolean()),
    ("compile", boolean()),
    ("compile_unit", one_of("step", "blocks")),
    ("fullgraph", boolean()),
    ("model_state_sync", one_of("broadcast", "mean")),
    ("cp_attention", one_of("zigzag", "stream", "mask")),
    ("pp.microbatches", int_at_least(1)),
    ("pp.schedule", one_of("1f1b", "eager-1f1b", "gpipe")),
    ("cuda_graphs", boolean()),
    ("donate", boolean()),
    ("peak_flops", number_at_least(0.0)),
    ("deterministic", boolean()),
    ("precision", one_of("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")),
    ("max_consecutive_skips", int_at_least(0)),
    ("tensorboard", boolean()),
    ("export_hf", boolean()),
    ("host_memory", one_of("keep", "default")),
    ("gc_every", int_at_least(0)),
    ("prefetch", int_at_least(0)),
    ("dist_timeout_s", int_at_least(0)),
    ("checkpoint.enabled", boolean()),
    ("checkpoint.every", int_at_least(0)),
    ("checkpoint.keep", int_at_least(1)),
    ("checkpoint.keep_every", int_at_least(0)),
    ("checkpoint.async_restore", boolean()),
    ("checkpoint.resume_hyperparams", one_of("config", "checkpoint")),
    ("profile.start", int_at_least(0)),
    ("profile.stop", int_at_least(0)),
]
"""The training loop's own keys (the model's and the optimizer's are checked beside their code)."""
