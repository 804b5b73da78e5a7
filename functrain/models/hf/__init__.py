"""The Hugging Face family: any transformers causal LM (Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, ...)
trained from a model directory, with no model code here. `model.py` builds it on meta, initializes it
from a key and cuts it into stages at its decoder layers; `probe.py` checks its stages on a probe batch;
`weights.py` reads a directory's weights onto it; `loss.py` is its loss; `cache.py` decodes it through a KV
cache; `task.py` the Task the training loop runs (imported on its own by `functrain.main`).
The names below load on first use (`functrain._lazy`), so `checks.py` imports without torch.

Example:
    >>> from functrain.models import hf
    >>> template = hf.build_template(hf.load_config("dirs/qwen2-tiny"))
    >>> params = hf.init_params(template, rng.key(0))
    >>> loss_fn = hf.make_loss_fn(template, remat="full")
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.models.hf.cache import cached_model, run_cache
    from functrain.models.hf.export import export_directory, persistent_buffers
    from functrain.models.hf.loss import make_loss_fn, run_loss
    from functrain.models.hf.model import (
        HFModelError,
        StagingError,
        build_template,
        decoder_layers,
        eval_logits,
        head_name,
        init_params,
        load_config,
        refuse_axes,
        stages,
        tp_rules,
    )
    from functrain.models.hf.probe import check_stages, probe_subject, relative_error
    from functrain.models.hf.weights import read_params, with_buffers

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
