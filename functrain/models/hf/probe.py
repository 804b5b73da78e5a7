"""The hf family's build-time probes: whether its stages compose to the model's own forward (`check_stages`), and
what a probe runs of a large model (`probe_subject`: two decoder layers); `cache.py`'s probe shares both.

Example:
    >>> st = stages(template, share=check_stages(template))
"""

from __future__ import annotations

import torch

from functrain import functional, rng
from functrain.models.hf.model import (
    HFModel,
    HFModelError,
    StagingError,
    decoder_layers,
    final_norm,
    init_params,
    layer_view,
    stages,
)
from functrain.models.stages import LMStages

__all__ = ["PROBE_RTOL", "check_stages", "probe_subject", "relative_error"]

PROBE_NUMEL = 1 << 26  # a model of at most this many parameters is probed whole, a larger one on two layers
PROBE_RTOL = 1e-4  # the same ops in another order differ by float32 rounding: ~1e-6 relative


def check_stages(model: HFModel) -> bool:
    """Checks `stages(model)` on a probe batch: the stages composed must equal the base model's forward.

    The probe is 2 x 8 token ids through params from `init_params` on the CPU, in eval mode, on
    `probe_subject(model)` (the whole base model, or its first two layers), against the stages of those.

    Args:
      model: `build_template`'s model.

    Returns:
      Whether each layer also equals the one function it would share with the layers alike
      (`stages(model, share=...)`); True when no layers are alike.

    Raises:
      HFModelError: the stages composed differ from the base model's forward (the check and the
        number, in one line), or `stages` cannot cut the model.

    Example:
      >>> st = stages(template, share=check_stages(template))
    """
    st = stages(model)
    reference, path, keep = probe_subject(model)
    keep = list(range(len(st.blocks))) if keep is None else keep
    names = {*st.embed.names, *st.final.names, *(nm for i in keep for nm in st.blocks[i].names)}
    device = next((b.device for b in model.buffers()), torch.device("cpu"))
    p = init_params(model, rng.key(0), device=device, only=names)
    x = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    try:
        return _probe(st, reference, path, keep, p, x)
    except HFModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - a view the model's own code cannot run
        raise StagingError(
            f"{model.config.model_type}: its stages cannot run on a probe batch ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None


def probe_subject(model: HFModel) -> tuple[HFModel, str, list[int] | None]:
    """What a probe runs of `model`: its base model whole when the model has at most 2**26 parameters, else the
    base model on its first two decoder layers (its embedding and final norm kept).

    Args:
      model: `build_template`'s model.

    Returns:
      (the module, the base model's name in `model` (its params' prefix), the decoder layers it runs: None for
      all of them).

    Raises:
      HFModelError: a model over 2**26 parameters without a list of decoder layers (`decoder_layers`).

    Example:
      >>> reference, path, keep = probe_subject(big_template)        # (LlamaModel, "model", [0, 1])
    """
    if sum(p.numel() for p in model.parameters()) <= PROBE_NUMEL:
        return model.base_model, model.base_model_prefix, None
    path, _, layers = decoder_layers(model).rpartition(".")
    base = model.get_submodule(path)
    keep = list(range(min(len(base.get_submodule(layers)), 2)))
    return layer_view(base, layers, final_norm(base, layers), keep, side=True, norm=True), path, keep


def _probe(st: LMStages, reference: HFModel, path: str, keep: list[int], p: dict, x: torch.Tensor) -> bool:
    """`check_stages` on params `p` and ids `x`: raises when the stages composed differ from `reference`'s
    forward; whether each block equals its shared function."""
    device = x.device
    shared_ok = True
    with torch.no_grad():
        own = {nm[len(path) + 1 :]: t for nm, t in p.items() if nm.startswith(f"{path}.")}
        want = functional.apply(reference, own, input_ids=x, train=False).last_hidden_state  # (B, T, C)
        h = st.embed.fn(st.embed.params(p), x, None)  # (B, T, C)
        for i in keep:
            block = st.blocks[i]
            out = block.fn(block.params(p), h, None)
            if block.shared is not None:
                alone = block.shared(block.own(p), h, None, torch.tensor(i, device=device))
                shared_ok = shared_ok and relative_error(alone, out) <= PROBE_RTOL
            h = out
        got = st.final.fn(st.final.params(p), h, None)
    off = relative_error(got, want)
    if not off <= PROBE_RTOL:
        raise StagingError(
            f"{reference.config.model_type}: its stages composed differ from the base model's forward "
            f"by {off:.2g} (relative, on a probe batch)"
        )
    return shared_ok


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (inf for other shapes or non-finite values).

    Example:
      >>> relative_error(got, want) <= 1e-4
    """
    if a.shape != b.shape:
        return float("inf")
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / max(scale, 1e-30) if scale == scale else float("inf")
