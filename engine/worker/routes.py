"""The one start-up line that says which route every part of a step takes: linear-layer forms,
attention backend, how decode steps run, dtypes and the CPU kernels built, so that a user and a
bug report can see it."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, HalfWeightLinear, PackedLinear, PanelLinear
from engine.models.experts import ExpertLinears


def linear_form(module: nn.Module) -> str | None:
    """How a linear layer multiplies (None for modules that are not linear layers)."""
    if isinstance(module, PanelLinear):
        return f"panels ({module.held_as})"
    if isinstance(module, GatedPanelLinear):
        return f"gated panels ({_dtype(module.panels.dtype)})"
    if isinstance(module, HalfWeightLinear | PackedLinear):
        return type(module).__name__
    if isinstance(module, nn.Linear):
        return f"torch ({_dtype(module.weight.dtype)})"
    return None


def linear_forms(model: object) -> str:
    """Each linear-layer form with its count, most common first."""
    if not isinstance(model, nn.Module):
        return "n/a"
    forms = Counter(form for m in model.modules() if (form := linear_form(m)) is not None)
    return ", ".join(f"{count} {form}" for form, count in forms.most_common()) or "none"


def decode_route(model: object) -> str:
    """How a CPU decode step runs Conveyor's layers, as chosen when the model was built (the
    whole stack as one op, one op per layer, or op by op, with the reason)."""
    fused = getattr(model, "fused_decode", None)
    return "Hugging Face layers" if fused is None else fused.describe()


def experts_route(model: object) -> str:
    """How each layer of experts runs a step's experts, with its count ("" without experts)."""
    if not isinstance(model, nn.Module):
        return ""
    routes = Counter(m.route for m in model.modules() if isinstance(m, ExpertLinears))
    return ", ".join(f"{count} layers {route}" for route, count in routes.most_common())


def images_route(model: object) -> str:
    """How an image-text model takes its images ("" for a text model): the dtype its vision
    encoder computes in, and how the image tokens attend and are placed where that differs."""
    encoder = getattr(model, "image_encoder", None)
    if encoder is None:
        return ""
    parts = [f"encoder in {_dtype(encoder.dtype)}"]
    if encoder.both_ways:
        parts.append("each image's tokens attend both ways, an image computed in one step")
    if encoder.grid_merge is not None:
        parts.append("positions on three axes")
    if encoder.feeds_layers:
        parts.append("encoder rows added after the first decoder layers")
    return ", ".join(parts)


def kernels_route() -> str:
    """Which CPU kernel groups loaded, for which instruction-set target."""
    result = cpu_ops.build_result()
    if not result.built:
        return f"none ({next(iter(result.failed.values()), 'not built')})"
    missing = f"; without {', '.join(result.failed)}" if result.failed else ""
    return f"{', '.join(result.built)} for -march={cpu_build.march()}{missing}"


def describe(
    model: object,
    attention: str,
    dtype: torch.dtype,
    compute: torch.dtype,
    cache_dtype: torch.dtype,
    device: torch.device,
    async_scheduling: bool = False,
    kv_scales: str = "",
    sampling: str = "",
    compiled: str = "",
    pooling: bool = False,
    attention_features: str = "",
) -> str:
    scales = f" (scales {kv_scales})" if kv_scales else ""
    features = f" ({attention_features})" if attention_features else ""
    parts = [
        f"model implementation {getattr(model, 'name', type(model).__name__)}",
        f"dtype {_dtype(dtype)} (compute {_dtype(compute)})",
        f"KV cache {_dtype(cache_dtype)}{scales}",
        f"attention {attention}{features}",
        f"linear layers: {linear_forms(model)}",
        f"async scheduling {'on' if async_scheduling else 'off'}",
    ]
    experts = experts_route(model)
    if experts:
        parts.append(f"experts: {experts}")
    if pooling:
        parts.append("runner pooling (each prompt's last hidden state, no sampling)")
    elif sampling:
        parts.append(f"sampling {sampling}")
    if compiled:
        parts.append(f"layers {compiled}")
    images = images_route(model)
    if images:
        parts.append(f"images: {images}")
    if device.type == "cpu":
        parts += [f"decode: {decode_route(model)}", f"CPU kernels: {kernels_route()}"]
    shard = getattr(model, "shard", None)
    if shard is not None:
        parts.append(
            f"tensor parallel {shard.shape.size} (each rank: {shard.shape.local_heads} heads, "
            f"{shard.shape.local_kv_heads} KV heads, {shard.shape.local_vocab} vocabulary rows)"
        )
    return "; ".join(parts)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
