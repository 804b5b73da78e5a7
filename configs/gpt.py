"""Byte-level GPT on the Python standard library's sources (no network needed).

Command (from the repository root):

    python -m functrain.main --config=configs/gpt.py

Expected result (2 CPU cores, torch 2.13), measured from a fresh clone with the README's command
(14 minutes in all, pip included): 75 s of cold compilation (~20 s warm: `compile_cache`), then
0.26-0.31 s/step for 2500 steps; train loss falls from ~5.6 (ln 256, uniform over bytes) to 1.15,
val loss 1.26 at the end, and the final sample looks like indented Python (`def`, `raise
ValueError(...)`, `return`). Session 1 measured 0.22 s/step on a quieter machine; an A/B of that
commit against this one, run back to back, gave 0.30 vs 0.28 s/step with identical losses.
Metrics land in `runs/gpt/metrics.jsonl`, TensorBoard events in `runs/gpt/tb`.

Variants (`--config=configs/gpt.py:<variant>`):
  tiny   smoke test: about a minute (45 s of it compiling); loss ~5.6 -> 2.84, val 2.90 at step 150.
  gpt2   GPT-2 small (124M with a 50304 vocab; 85M non-embedding) for a GPU: point data.path at
         nanoGPT-style uint16 .bin files (e.g. OpenWebText) and set the batch to your memory.

Override anything: `--config.optim.lr=3e-4 --config.steps=2000 --config.model.n_layer=6`.
Multi-process: `torchrun --standalone --nproc_per_node=2 -m functrain.main --config=configs/gpt.py`.
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    """The default run, or one of the variants named in the module docstring."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 2500  # ~0.27 s/step on 2 CPU cores: about 12 minutes
    c.stop_at = 0  # stop (checkpointed) after this step, as if preempted; 0 = run to `steps`
    c.batch_size = 32  # global batch, in sequences (split over the data-parallel ranks)
    c.accum_steps = 1  # microbatches per step (gradient accumulation inside the one compiled step)
    c.log_every = 50
    c.eval_every = 500
    c.eval_batches = 8
    c.compile = True
    # Where compiled graphs are cached across runs (functrain/compile_cache.py): "user" (per-user
    # dir: $TORCHINDUCTOR_CACHE_DIR or ~/.cache/functrain/inductor), "workdir" (<workdir>/compile_cache:
    # a restart from a copy of the workdir compiles warm), "off" (always cold), or a directory path.
    c.compile_cache = "user"
    c.donate = True
    # CPU runs are bit-reproducible without it (functrain/ops.py); on CUDA, True turns on
    # torch.use_deterministic_algorithms (atomic-add kernels replaced), needed for bit-identical reruns.
    c.deterministic = False
    c.loss_chunk_size = 0  # > 0: chunked cross-entropy through the tied head; logits never whole
    # activation checkpointing: auto | none | full | N (every N-th block); see bench/remat.py. "auto":
    # none on one process; full on a mesh, where a recomputed block's gathered params are freed after
    # its forward and gathered again for its backward, so no rank ever holds the whole model.
    c.remat = "auto"
    c.precision = "fp32"  # fp32 | bf16 | fp16 (loss-scaled); params and Adam moments stay fp32
    c.max_consecutive_skips = 10  # non-finite loss/grad norm skips the update; stop after this many in a row (0 = never skip)
    c.tensorboard = True  # event files in <workdir>/tb (written without the tensorboard package)
    c.device = "auto"  # "auto" = cuda if available, else cpu
    # keep: freed host memory stays in the process (functrain/memory.py: page faults on fresh
    # buffers cost 17% of the default step on CPU); default: glibc's own policy.
    c.host_memory = "keep"
    # Python's automatic garbage collection is off during training; a collection runs every this many
    # steps on every rank at once (0 = leave Python's own collector on).
    c.gc_every = 50

    c.model = ml_collections.ConfigDict()
    c.model.name = "gpt"  # the model family: functrain/models/<name>/
    c.model.vocab_size = 0  # 0 = take it from the data (256 for bytes)
    c.model.block_size = 128
    c.model.n_layer = 4
    c.model.n_head = 4
    c.model.n_embd = 128
    c.model.dropout = 0.0  # small model, 2500 steps, 30 MB of text: it does not overfit
    c.model.bias = False

    c.data = ml_collections.ConfigDict()
    c.data.path = "stdlib"  # "stdlib", a text file, a directory of text, or a dir with train.bin/val.bin
    c.data.cache_dir = ""  # "" = <workdir>/data

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # adamw | sgd
    c.optim.lr = 3e-3  # high for a GPT, fine for a 0.8M-param byte model with warm-up
    c.optim.min_lr = 3e-4
    c.optim.schedule = "cosine"  # cosine | constant | linear
    c.optim.warmup_steps = 100
    c.optim.weight_decay = 0.1  # matrices only; biases, norms and embeddings' positions are masked
    c.optim.b1 = 0.9
    c.optim.b2 = 0.95  # GPT practice: faster second-moment adaptation than 0.999
    c.optim.eps = 1e-8
    c.optim.momentum = 0.9  # sgd only
    c.optim.clip = 1.0  # global-norm clipping; 0 disables
    c.optim.mu_dtype = "float32"  # adamw moment storage: float32 | bfloat16 (halves optimizer memory)
    c.optim.nu_dtype = "float32"

    c.mesh = ml_collections.ConfigDict()
    c.mesh.dp_replicate = 1
    c.mesh.dp_shard = -1  # -1 = the rest of the world size
    c.mesh.tp = 1

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 500  # 0 disables periodic saves (a final save still happens)
    c.checkpoint.keep = 2
    c.checkpoint.keep_every = 0  # also keep every N-th step forever; 0 = off
    c.checkpoint.enabled = True
    c.checkpoint.async_restore = True  # stream the restore in while the step compiles
    # Start from another run's params (a step dir, its checkpoints dir or its workdir) with a fresh
    # optimizer; ignored once this workdir has its own checkpoint (a restart resumes that instead).
    c.checkpoint.init_from = ""

    c.profile = ml_collections.ConfigDict()
    c.profile.start = 0  # torch.profiler trace of steps [start, stop) into <workdir>/profile
    c.profile.stop = 0  # stop <= start: no profiling

    c.sample = ml_collections.ConfigDict()
    c.sample.prompt = "def "
    c.sample.max_new_tokens = 300
    c.sample.temperature = 0.8
    c.sample.top_k = 0  # 0 = no top-k filtering

    if variant in (None, "", "default"):
        pass
    elif variant == "tiny":
        c.steps = 150
        c.batch_size = 16
        c.log_every = 10
        c.eval_every = 50
        c.eval_batches = 2
        c.model.block_size = 64
        c.model.n_layer = 2
        c.model.n_head = 2
        c.model.n_embd = 64
        c.optim.lr = 1e-2  # tiny model, few steps: a large rate gets the loss down fast
        c.optim.min_lr = 1e-3
        c.optim.warmup_steps = 10
        c.checkpoint.every = 50
        c.sample.max_new_tokens = 100
    elif variant == "gpt2":
        c.steps = 600_000
        c.batch_size = 480  # x 1024 tokens = ~0.5M tokens per step, as GPT-2
        c.accum_steps = 40  # 12 sequences per microbatch fit an 80 GB GPU in fp32
        c.log_every = 10
        c.eval_every = 1000
        c.eval_batches = 50
        c.model.vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64
        c.model.block_size = 1024
        c.model.n_layer = 12
        c.model.n_head = 12
        c.model.n_embd = 768
        c.loss_chunk_size = 1024  # 50k vocab: (12 x 1024) x 50304 fp32 logits would be 2.4 GB
        c.data.path = "data/openwebtext"  # nanoGPT's prepare.py output: train.bin / val.bin
        c.optim.lr = 6e-4
        c.optim.min_lr = 6e-5
        c.optim.warmup_steps = 2000
        c.checkpoint.every = 2000
    else:
        raise ValueError(f"unknown variant {variant!r}; use one of: default, tiny, gpt2")
    return c
