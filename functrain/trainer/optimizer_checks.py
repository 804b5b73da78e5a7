"""The checks of a run config's `optim` keys (see `functrain.config_checks`): plain Python, no torch, so
`python -m functrain.main` reports a bad value before the heavy modules load.
`functrain.trainer.optimizer` (which reads these keys) re-exports `CHECKS`.

Example:
    >>> config_checks.check_all(config, CHECKS)
"""

from __future__ import annotations

from functrain import config_checks

__all__ = ["CHECKS", "DTYPES"]

DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
"""The names `optim.mu_dtype` / `optim.nu_dtype` accept."""

CHECKS: list = [
    ("optim.name", config_checks.one_of("adamw", "sgd")),
    ("optim.lr", config_checks.number_at_least(0.0)),
    ("optim.min_lr", config_checks.number_at_least(0.0)),
    ("optim.schedule", config_checks.one_of("cosine", "constant", "linear")),
    ("optim.warmup_steps", config_checks.int_at_least(0)),
    ("optim.warmup_from_zero", config_checks.boolean()),
    ("optim.weight_decay", config_checks.number_at_least(0.0)),
    ("optim.b1", config_checks.number_in(0.0, 1.0)),
    ("optim.b2", config_checks.number_in(0.0, 1.0)),
    ("optim.eps", config_checks.number_at_least(0.0, strict=True)),
    ("optim.momentum", config_checks.number_in(0.0, 1.0)),
    ("optim.clip", config_checks.number_at_least(0.0)),
    ("optim.mu_dtype", config_checks.one_of(*DTYPES)),
    ("optim.nu_dtype", config_checks.one_of(*DTYPES)),
    ("optim.fused", (lambda x: x in (None, True, False), "True, False, or unset (the kernel in eager steps only)")),
    config_checks.relation(
        ("optim.fused", "optim.name"),
        lambda fused, name: not fused or name == "adamw",
        "the fused update is torch's AdamW kernel: set --config.optim.name=adamw or --config.optim.fused=False",
    ),
    config_checks.relation(
        ("optim.fused", "optim.mu_dtype", "optim.nu_dtype"),
        lambda fused, mu, nu: not fused or {mu, nu} <= {"float32", "fp32"},
        "torch's fused AdamW kernel keeps the moments in the params' dtype: set both to float32 or "
        "--config.optim.fused=False",
    ),
]
"""The checks of `config.optim`."""
