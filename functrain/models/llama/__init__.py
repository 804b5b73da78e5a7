"""The Llama family: the model and its loss (`model.py`: RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention, optional tied head), Hugging Face interop (`hf.py`) and the Task the training loop runs
(`task.py`, imported on its own by `functrain.main`).
The names below load on first use (`functrain._lazy`), so `checks.py` imports without torch.

Example:
    >>> from functrain.models import llama
    >>> with torch.device("meta"):
    ...     template = llama.Llama(llama.LlamaConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64))
    >>> params = llama.init_params(template, rng.key(0))
    >>> loss_fn = llama.make_loss_fn(template, remat="full")
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.models.llama.hf import config_from_hf, export_hf_llama, hf_llama_config, hf_name, load_hf_params
    from functrain.models.llama.model import (
        TP_RULES,
        Llama,
        LlamaConfig,
        flops_per_token,
        init_params,
        make_loss_fn,
        num_params,
        stages,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
