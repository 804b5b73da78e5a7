"""The trainer's own config keys (loop, compile, optimizer, mesh, checkpoints, profiler), with their
defaults: a model family's config file starts from `trainer_config()` and adds `model`, `data`,
`sample` and its own keys (`configs/gpt.py`, `configs/llama.py`).

Example:
    >>> c = trainer_config()
    >>> c.steps, c.optim.lr = 2000, 1e-3
"""

from __future__ import annotations

from typing import Any

import ml_collections

__all__ = ["data_config", "trainer_config"]


def trainer_config() -> ml_collections.ConfigDict:
    """The trainer's keys with their defaults (each explained beside it).

    Returns:
      A ConfigDict; a family's `get_config()` adds its keys and overrides values.

    Example:
      >>> c = trainer_config(); c.model = ml_collections.ConfigDict(); c.model.name = "gpt"
    """
    c = ml_collections.ConfigDict()
    c.steps = 1000
    c.seed = 0
    c.epochs = 0.0  # > 0: train this many epochs over the examples (supervised data) in place of `steps`
    c.stop_at = 0  # stop (checkpointed) after this step, as if preempted; 0 = run to `steps`
    c.batch_size = 32  # global batch, in sequences (split over the data-parallel ranks)
    c.accum_steps = 1  # microbatches per step (gradient accumulation inside the one compiled step)
    c.log_every = 50
    c.eval_every = 500
    c.eval_batches = 8
    # Multiple-choice evaluation every eval_every steps and at the end (docs/guide.md "Evaluation"):
    # comma-separated jsonl files (HellaSwag's official format, or {"context", "choices", "label"})
    # and/or "next_lines" (built from the run's own validation text); logs mc/<name>/acc, acc_norm,
    # acc_mean_token. "" = none; "auto" = next_lines where the run can make it (text data), else none.
    c.eval = ml_collections.ConfigDict()
    c.eval.tasks = ""
    c.eval.limit = 0  # examples per task (0 = all)
    c.eval.batch_size = 32  # rows (example x choice) per forward on each rank
    c.eval.truncate = (
        False  # an example longer than the block: False = stop with one line, True = cut its context's head
    )
    c.eval.compile = True  # with compile=True: the scoring forward compiled, one graph per bucket length
    # acc_mean_token's rendering: "nanogpt" as nanoGPT's hellaswag.py (the record's raw ctx, " " + ending, each
    # tokenized alone: its acc_norm); "harness" as acc and acc_norm (lm-eval's cleaned query)
    c.eval.mean_token = "nanogpt"
    # LoRA (docs/guide.md "LoRA"): rank > 0 trains low-rank adapters beside the targeted linear layers
    # while the base stays frozen (not differentiated, no optimizer state, not in the checkpoints).
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 0  # 0 = off: every param trains
    c.lora.alpha = 16.0  # the adapters' scale is alpha / rank (alpha / sqrt(rank) with rslora)
    c.lora.targets = "all-linear"  # or a regex over the linear layers' names ("q_proj|v_proj")
    c.lora.dropout = 0.0  # on the adapters' input, drawn from the step's key
    c.lora.rslora = False
    # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) the adapters start from,
    # its rank, alpha, layers and base checked against the run's ("" = fresh adapters: A random, B zero)
    c.lora.init_from = ""
    # Preference tuning (docs/guide.md "Preference tuning"): read when the data are chosen/rejected pairs
    # (data.format=preference, or records with those fields); the reference is a frozen copy of the starting
    # params, or under LoRA the base with the adapters off
    c.preference = ml_collections.ConfigDict()
    c.preference.loss = "sigmoid"  # sigmoid (DPO) | ipo | hinge, as TRL's DPOTrainer defines them
    c.preference.beta = 0.1  # the temperature (IPO: its tau)
    c.preference.label_smoothing = 0.0  # sigmoid only: the chance a pair's label is flipped (conservative DPO)
    # True: the reference's log-probs of every pair computed once before step 1 (kept in the data cache, named
    # by the starting params' digest) and read from the batches: no reference held or run while training
    c.preference.precompute_reference = False
    # Reinforcement learning from rewards (docs/guide.md "Reinforcement learning from rewards"): read when the data
    # are prompts alone (data.format=prompts, records with only a `prompt` field, or "additions"); batch_size
    # counts prompts, each sampled num_generations times from the policy, scored by the reward functions
    c.grpo = ml_collections.ConfigDict()
    c.grpo.rewards = ()  # "module:function" names: f(prompts, completions, **fields) -> a float or None each
    c.grpo.reward_weights = ()  # one per function (() = 1 each)
    c.grpo.num_generations = 8  # completions per prompt (G)
    c.grpo.max_new_tokens = 64  # the longest completion (prompt + it within model.block_size)
    c.grpo.temperature = 1.0
    c.grpo.top_k = 0  # 0 = the whole vocabulary
    c.grpo.loss = "dapo"  # dapo | grpo | dr_grpo | bnpo, as TRL's GRPOTrainer's loss_type
    c.grpo.beta = 0.0  # the k3 KL's weight (> 0: a reference, a frozen copy or under LoRA the adapters off)
    c.grpo.epsilon = 0.2  # the ratio's clip below
    c.grpo.epsilon_high = 0.0  # the clip above (0 = epsilon)
    c.grpo.scale_rewards = "group"  # group | batch | none: what an advantage is divided by
    c.grpo.num_iterations = 1  # optimizer steps per rollout (more: the old log-probs recomputed at the rollout)
    c.grpo.mask_truncated = False  # a completion cut at max_new_tokens scores no token
    c.compile = True
    # What one compiled graph covers: "step" (the whole step, one graph: fastest steps, compile time
    # grows with depth) or "blocks" (a staged model's
    # embedding, block and head each a graph of their own, every block running the same one, and the
    # optimizer update block by block: as many graphs and about the same cold compile at any depth;
    # README "Compile units").
    c.compile_unit = "step"
    # True: the step is one graph, and a graph break in the model stops with one line naming it.
    # False: torch.compile compiles around graph breaks (several graphs; for modules that print,
    # log or branch on a tensor's value), still without recompiles from step to step.
    c.fullgraph = True
    # What a data-parallel run keeps of the model state (BatchNorm statistics each rank updates from
    # its own rows): "broadcast" dp rank 0's (as DDP), "mean" the floating buffers' mean over dp ranks.
    c.model_state_sync = "broadcast"
    # Replay the compiled step as CUDA graphs (inductor's cudagraph trees): one launch per step
    # instead of hundreds, for small launch-bound models. CUDA, compile=True, compile_unit="step".
    c.cuda_graphs = False
    # Where compiled graphs are cached across runs (functrain/compiler/cache.py): "user" (per-user
    # dir: $TORCHINDUCTOR_CACHE_DIR or ~/.cache/functrain/inductor), "workdir" (<workdir>/compile_cache:
    # a restart from a copy of the workdir compiles warm), "off" (always cold), or a directory path.
    c.compile_cache = "user"
    c.donate = True
    # Peak FLOP/s of one device, the MFU's denominator; 0: the data sheet's for known GPUs, else
    # measured (a matmul probe at the start and after every log window, the best kept).
    c.peak_flops = 0.0
    # CPU runs are bit-reproducible without it (functrain/ops/); on CUDA, True turns on
    # torch.use_deterministic_algorithms (atomic-add kernels replaced), needed for bit-identical reruns.
    c.deterministic = False
    c.precision = "fp32"  # fp32 | bf16 | fp16 (loss-scaled); params and Adam moments stay fp32
    # a non-finite loss or grad norm skips the update; stop after this many in a row, checked at log steps (0 = never)
    c.max_consecutive_skips = 10
    c.tensorboard = True  # event files in <workdir>/tb (with the tensorboard package; JSONL always)
    c.export_hf = False  # write <workdir>/hf at the end (a family with an export: a transformers directory)
    c.device = "auto"  # "auto" = cuda if available, else cpu
    # keep: freed host memory stays in the process (functrain/trainer/memory.py: page faults on fresh
    # buffers cost 17% of the default step on CPU); default: glibc's own policy.
    c.host_memory = "keep"
    # Python's automatic garbage collection is off during training; a collection runs every this many
    # steps on every rank at once (0 = leave Python's own collector on).
    c.gc_every = 50
    c.prefetch = 2  # training batches made ahead on a background thread (0 = made when the step asks)
    # Collective timeout, in seconds, of the process group and of every group of the mesh: a rank
    # left waiting (a peer crashed or issued another collective) fails after this long with the
    # backend's error. 0 = torch's default (30 minutes); keep it above the longest first-step
    # compile and checkpoint wait of the run.
    c.dist_timeout_s = 0

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # adamw | sgd
    c.optim.lr = 3e-4
    c.optim.min_lr = 3e-5
    c.optim.schedule = "cosine"  # cosine | constant | linear
    c.optim.warmup_steps = 100
    # False: the warm-up rate is lr * (t + 1) / (warmup_steps + 1) at update t (nanoGPT's), so the first
    # update already moves the params; True: lr * t / warmup_steps, 0 at the first update (optax's
    # linear warm-up from init_value=0, and functrain's curve before this key existed).
    c.optim.warmup_from_zero = False
    c.optim.weight_decay = 0.1  # matrices only; biases, norms and embeddings' positions are masked
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95  # GPT practice: faster second-moment adaptation than 0.999
    c.optim.eps = 1e-8
    c.optim.momentum = 0.9  # sgd only
    c.optim.clip = 1.0  # global-norm clipping; 0 disables
    c.optim.mu_dtype = "float32"  # adamw moment storage: float32 | bfloat16 (halves optimizer memory)
    c.optim.nu_dtype = "float32"
    # adamw only: True runs the update through torch's fused AdamW kernel after the compiled loss too (one
    # process), as torch.optim.AdamW(fused=True) does: no update graph to compile (this run's first step
    # 53 -> 42 s on 2 cores; docs/results.md), the same math to float rounding, no update_norm metric.
    # Unset (None): the kernel in eager steps only (compile=False), compiled steps compile the update;
    # False: never the kernel.
    c.optim.fused = ml_collections.config_dict.placeholder(bool)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.dp_replicate = 1
    c.mesh.dp_shard = -1  # -1 = the rest of the world size
    c.mesh.cp = 1  # context parallel: each sequence split over cp ranks (functrain.parallel.context)
    c.mesh.tp = 1
    c.mesh.pp = (
        1  # pipeline stages: the blocks cut over pp ranks, each a mesh of the axes above (functrain.parallel.pipeline)
    )
    c.pp = ml_collections.ConfigDict()
    c.pp.microbatches = 1  # mesh.pp > 1: microbatches per step (the gradients' mean; in place of accum_steps)
    # "1f1b" holds at most pp - stage microbatches' activations, "gpipe" all of them, "eager-1f1b" one more
    # than 1f1b and keeps the bubble near (pp - 1) / (microbatches + pp - 1) when single actions' times vary
    c.pp.schedule = "1f1b"
    # Context-parallel attention (mesh.cp > 1; functrain.parallel.context.KERNELS): "zigzag" all-gathers
    # one layer's keys and values; "stream" fetches them a chunk at a time (less memory, 2N collectives a
    # layer); "mask" is one attention under a (T/cp) x T mask.
    c.cp_attention = "zigzag"

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 500  # 0 disables periodic saves (a final save still happens)
    c.checkpoint.keep = 2
    c.checkpoint.keep_every = 0  # also keep every N-th step forever; 0 = off
    c.checkpoint.enabled = True
    c.checkpoint.async_restore = True  # stream the restore in while the step compiles
    # On resume the config's hyper-parameters (lr, schedule, betas, eps, weight decay, clip,
    # momentum: tensors in the optimizer state) replace the checkpoint's, and the run prints which
    # changed; "checkpoint" keeps the checkpoint's.
    c.checkpoint.resume_hyperparams = "config"
    # Start from another run's params (a step dir, its checkpoints dir or its workdir) with a fresh
    # optimizer; ignored once this workdir has its own checkpoint (a restart resumes that instead).
    c.checkpoint.init_from = ""

    c.profile = ml_collections.ConfigDict()
    c.profile.start = 0  # torch.profiler trace of steps [start, stop) into <workdir>/profile
    c.profile.stop = 0  # stop <= start: no profiling

    return c


def data_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The keys of the data a language-model family reads (`functrain.data.run_data`), with defaults.

    Args:
      **overrides: keys to set instead of their defaults (each must be one of them).

    Returns:
      A ConfigDict for `config.data`; a family adds its own keys (e.g. `tokenizer`).

    Example:
      >>> c.data = data_config(path="/data/web/*.parquet", sampling="epochs")
    """
    d = ml_collections.ConfigDict()
    # "stdlib", a text file, a directory of text, a dir with train.bin/val.bin, parquet/jsonl(.gz)
    # shards (a file, a directory of them or a glob), or a token cache directory they were written to
    d.path = "stdlib"
    d.cache_dir = ""  # "" = <workdir>/data
    d.val_fraction = 0.015  # share of the files (text), documents (shards) or bytes (one file) held out
    d.text_field = "text"  # parquet column / jsonl key holding each document's text
    d.sampling = "windows"  # windows: random windows (with replacement) | epochs: each window once per epoch
    # A weighted mixture instead of `path`: sources = {"web": "/data/web", "code": "/data/code/*.jsonl"},
    # mixture = {"web": 0.7, "code": 0.3} (in a config file: dicts cannot be typed as flags)
    d.sources = ml_collections.ConfigDict()
    d.mixture = ml_collections.ConfigDict()
    d.max_bad_line_fraction = 0.0  # jsonl lines that are not JSON a shard may have (skipped); above: stop
    d.tokenize_workers = (
        0  # processes per rank that tokenize; 0 = the rank's share of the cores (its own process under 64 MiB)
    )
    # Supervised examples (jsonl/parquet records; docs/guide.md "Fine-tuning"): "auto" finds the format
    # from the first record's fields (a `text` field alone: pretraining as above)
    d.format = "auto"  # auto | text | prompt_completion | messages | alpaca | preference
    d.train_on = (
        "auto"  # what is learned: completion | assistant | last | all (auto: completion, assistant for messages)
    )
    d.fields = ml_collections.ConfigDict()  # {format field: the records' field}, e.g. {"prompt": "question"}
    d.packing = False  # pack whole examples into rows (best-fit-decreasing; attention within each example)
    d.too_long = "drop"  # an example longer than block_size + 1 tokens: drop (counted) | truncate
    d.chat_template = (
        "auto"  # messages: the model directory's template | "default" (ChatML) | a .jinja file | a directory
    )
    # The end-of-text token examples end with and generation stops at: "" = the tokenizer directory's
    # (tokenizer_config.json's eos_token, as transformers reads it); or a token of its vocabulary
    d.eos_token = ""
    # A resume whose data differs from its checkpoint's (files, sizes, sha256, tokenizer) stops;
    # True goes on with the data as it is and logs what changed
    d.allow_changed = False
    for key, value in overrides.items():
        if key not in d:
            raise KeyError(f"data_config: no key {key!r}; the keys are {sorted(d)}")
        d[key] = value
    return d
