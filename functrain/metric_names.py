"""The names of the metrics functrain reports, in one place.

Internals: docs/internals.md "functrain.metric_names".

Example:
    >>> from functrain import metric_names as M
    >>> state, m = step(state, batch); print(float(m[M.LOSS]), float(m[M.LR]))
"""

from __future__ import annotations

__all__ = [
    "LOSS",
    "GRAD_NORM",
    "UPDATE_NORM",
    "PARAM_NORM",
    "LR",
    "SKIPPED",
    "CONSECUTIVE_SKIPS",
    "SKIPPED_TOTAL",
    "LOSS_SCALE",
    "REWARDS_CHOSEN",
    "REWARDS_REJECTED",
    "REWARDS_ACCURACIES",
    "REWARDS_MARGINS",
    "LOGPS_CHOSEN",
    "LOGPS_REJECTED",
    "KL",
    "CLIP_LOW",
    "CLIP_HIGH",
    "CLIP_REGION",
    "ENTROPY",
    "TARGETS",
    "TARGETS_PER_S",
    "VAL_LOSS",
    "TOKENS_PER_S",
    "STEP_TIME_S",
    "MFU",
    "ETA",
    "PEAK_MEM_MB",
    "DATA_WAIT_MS",
    "EPOCH",
    "EPOCH_FRACTION",
    "PER_STEP_FLAGS",
    "QUIET_WHEN_ZERO",
]

# From the train step (0-d tensors).
LOSS = "loss"  # the loss (mean over microbatches and data-parallel ranks; per target token with count_targets)
TARGETS = "targets"  # with count_targets: the step's target tokens, over every microbatch and rank
GRAD_NORM = "grad_norm"  # global L2 norm of the gradients, before clipping
UPDATE_NORM = "update_norm"  # global L2 norm of the optimizer's update (before a skip)
LR = "lr"  # the learning rate the update used (reported by the optimizer, see optim.report)
SKIPPED = "skipped"  # 1.0 when this step's update was skipped (non-finite loss or grad norm)
CONSECUTIVE_SKIPS = "consecutive_skips"  # updates skipped in a row up to this step
SKIPPED_TOTAL = "skipped_total"  # updates skipped since the start of the run
LOSS_SCALE = "loss_scale"  # the fp16 dynamic loss scale this step used

# From a preference objective's loss (`functrain.preference`; TRL's names): means over the step's pairs.
REWARDS_CHOSEN = "rewards/chosen"  # beta * (log pi - log pi_ref) of the chosen completions
REWARDS_REJECTED = "rewards/rejected"  # ... of the rejected ones
REWARDS_ACCURACIES = "rewards/accuracies"  # the share of pairs whose chosen reward exceeds the rejected one's
REWARDS_MARGINS = "rewards/margins"  # chosen minus rejected reward
LOGPS_CHOSEN = "logps/chosen"  # the policy's summed log-probs of the chosen completions
LOGPS_REJECTED = "logps/rejected"  # ... of the rejected ones

# From a GRPO loss (`functrain.grpo`; TRL's names): means over the step's completion tokens.
KL = "kl"  # the k3 estimate of KL(policy || reference) per token (with a reference)
CLIP_LOW = "clip_ratio/low_mean"  # the share of tokens whose ratio is clipped below (negative advantage)
CLIP_HIGH = "clip_ratio/high_mean"  # ... clipped above (positive advantage)
CLIP_REGION = "clip_ratio/region_mean"  # ... clipped either way
ENTROPY = "entropy"  # the entropy of the policy's next-token distribution at the sampling temperature

# From the training loop, at log / eval time (Python floats).
PARAM_NORM = "param_norm"  # global L2 norm of the params after the step (taken when logging)
VAL_LOSS = "val_loss"
TOKENS_PER_S = "tokens_per_s"
TARGETS_PER_S = "targets_per_s"  # the logged step's target (supervised) tokens over the window's step time
STEP_TIME_S = "step_time_s"
MFU = "mfu"  # model FLOP utilization against the device's (measured or published) peak
ETA = "eta"
PEAK_MEM_MB = "peak_mem_mb"
DATA_WAIT_MS = "data_wait_ms"  # per step, the time the loop waited for its batch (prefetched: ~0)
EPOCH = "epoch"  # data.sampling="epochs": the epoch the run is in ("epoch/<source>" for a mixture)
EPOCH_FRACTION = "epoch_fraction"  # ... and the fraction of it consumed

PER_STEP_FLAGS = (SKIPPED, CONSECUTIVE_SKIPS)  # about one step only: not written to the log
QUIET_WHEN_ZERO = (SKIPPED_TOTAL,)  # printed once non-zero (files get every value)
