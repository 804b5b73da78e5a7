"""Generation through a KV cache: prompts prefilled once, then one compiled decode step per token.

`kv_cache.py` is the cache (state: a pytree of preallocated keys and values) and the view a decoder's
attention reads it through; `generator.py` the `Generator` over requests as users make them (prompts of
different lengths, n samples each, keyed sampling, stop ids and rules, log-probabilities).

Example:
    >>> from functrain.generation import Generator, Sampling
    >>> gen = Generator.of(template, batch_size=8)
    >>> [[c]] = gen(params, [tok.encode("def ")], 64, key=rng.key(0), sampling=Sampling(temperature=0.8))
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:  # the public names; at run time each loads on first use (functrain._lazy)
    from functrain.generation.generator import (
        CachedModel,
        Completion,
        GenerationError,
        Generator,
        Sampling,
        pick,
        request_keys,
    )
    from functrain.generation.kv_cache import Cached, KVCache, LayerCache, cached

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
