"""The GPT family: the model and its loss (`model.py`), Hugging Face GPT-2 interop
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

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.models.gpt.hf import export_hf_gpt2, hf_gpt2_config, import_hf_gpt2
    from functrain.models.gpt.model import (
        GPT,
        TP_RULES,
        GPTConfig,
        GPTStages,
        flops_per_token,
        gpt_hidden,
        gpt_loss,
        init_params,
        make_loss_fn,
        num_params,
        stages,
    )
    from functrain.models.inference import generate
    from functrain.models.lm import cross_entropy

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
