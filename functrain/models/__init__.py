"""Models: plain nn.Modules with no parallelism inside, each with its sharding rules beside it."""

from functrain.models.gpt import (
    GPT,
    TP_RULES,
    GPTConfig,
    cross_entropy,
    flops_per_token,
    generate,
    init_params,
    num_params,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "TP_RULES",
    "cross_entropy",
    "flops_per_token",
    "generate",
    "init_params",
    "num_params",
]
