"""Data: corpora and parquet/jsonl shards to cached token files, and stateless batches keyed by
(seed, step, rank): random windows, epochs without replacement, weighted mixtures, prefetched; and
supervised examples (prompt/completion, messages, alpaca) with target masks, padded or packed; preference
pairs rendered as TRL renders them.

The names below load on first use (`functrain._lazy`): the tokenizing worker processes import this
package without torch.
"""

from typing import TYPE_CHECKING

from functrain._lazy import lazy_exports

if TYPE_CHECKING:
    from functrain.data.batches import eval_batches, get_batch
    from functrain.data.corpus import Dataset, load_dataset, train_tokenizer
    from functrain.data.documents import is_val, stdlib_files, train_documents, validation_documents
    from functrain.data.entry import chat_template, run_data, supervised_format
    from functrain.data.errors import DataError
    from functrain.data.examples import ExampleSet, ExampleSpec, load_examples
    from functrain.data.mixture import LMData, lm_data, parse_mixture
    from functrain.data.packing import assemble, best_fit_decreasing
    from functrain.data.pairs import TRUNCATION, Pair, pair_rows, render_pair
    from functrain.data.placement import Batching, Placement, TextOptions
    from functrain.data.prefetch import Prefetcher
    from functrain.data.prompts import PromptData, Share, prompt_data
    from functrain.data.sampling import SAMPLINGS, Sampler, mixture_rows, permute
    from functrain.data.sft import ExampleSampler, SFTData, sft_data
    from functrain.data.shards import is_shard_source, shard_files
    from functrain.data.stdlib_sft import builtin_format, builtin_source, stdlib_pairs
    from functrain.data.supervised import (
        ChatTemplate,
        chat_template_of,
        detect_format,
        first_record,
        has_chat_template,
        render,
    )
    from functrain.data.token_cache import open_token_cache, tokenize
    from functrain.data.tokenizer import (
        END_OF_TEXT,
        SEPARATOR,
        ByteTokenizer,
        HFTokenizer,
        IdTokenizer,
        VocabTokenizer,
        train_bpe,
    )
    from functrain.data.tokens import ConcatTokens

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
