"""The GPT family: the model (`model.py`), its loss (`loss.py`), Hugging Face GPT-2 interop
(`hf.py`) and the Task the training loop runs (`task.py`, imported on its own by `functrain.main`).
The names below load on first use (`functrain._lazy`), so `checks.py` imports without torch.

Example:
    >>> from functrain.models import gpt
    >>> with torch.device("meta"):
    ...     template = gpt.GPT(gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64))
    >>> params = gpt.init_params(template, rng.key(0))
    >>> loss_fn = gpt.make_loss_fn(template, chunk_size=1024)
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

_EXPORTS = {
    "GPT": "functrain.models.gpt.model:GPT",
    "GPTConfig": "functrain.models.gpt.model:GPTConfig",
    "GPTStages": "functrain.models.gpt.model:GPTStages",
    "TP_RULES": "functrain.models.gpt.model:TP_RULES",
    "cross_entropy": "functrain.models.gpt.model:cross_entropy",
    "export_hf_gpt2": "functrain.models.gpt.hf:export_hf_gpt2",
    "flops_per_token": "functrain.models.gpt.model:flops_per_token",
    "generate": "functrain.models.gpt.model:generate",
    "gpt_hidden": "functrain.models.gpt.loss:gpt_hidden",
    "gpt_loss": "functrain.models.gpt.loss:gpt_loss",
    "hf_gpt2_config": "functrain.models.gpt.hf:hf_gpt2_config",
    "import_hf_gpt2": "functrain.models.gpt.hf:import_hf_gpt2",
    "init_params": "functrain.models.gpt.model:init_params",
    "make_loss_fn": "functrain.models.gpt.loss:make_loss_fn",
    "num_params": "functrain.models.gpt.model:num_params",
    "stages": "functrain.models.gpt.model:stages",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
    from functrain.models.gpt.hf import export_hf_gpt2, hf_gpt2_config, import_hf_gpt2
    from functrain.models.gpt.loss import gpt_hidden, gpt_loss, make_loss_fn
    from functrain.models.gpt.model import (
        GPT,
        TP_RULES,
        GPTConfig,
        GPTStages,
        cross_entropy,
        flops_per_token,
        generate,
        init_params,
        num_params,
        stages,
    )
