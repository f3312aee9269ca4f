"""One LoRA adapter read from its folder, as PEFT saves it (`adapter_config.json` and
`adapter_model.safetensors` or `.bin`): for each layer's projection it targets, `A` `[r, in]`
and `B` `[out, r]` with the adapter's scale folded into `B`, so that the projection's output
gains `x A^T B^T`.

What the served delta cannot express is refused with the reason: DoRA, LoRA biases, modules
saved whole, embedding or LM-head adapters, per-module alphas, a rank over `--max-lora-rank`,
shapes that are not the base model's."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# The projections of a Llama-family layer an adapter may target, by PEFT's module names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# Other families' names for them: LFM2's attention's `out_proj` and its MLP's `w1`, `w3`, `w2`.
ALIASES = {"out_proj": "o_proj", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# (Under `self_attn` and `mlp`; `feed_forward` holds Bamba's, Jamba's and LFM2's MLPs, `mixer`
# Nemotron-H's blocks' attention or MLP.)
_KEY = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp|feed_forward|mixer)\.("
    + "|".join([*TARGETS, *ALIASES])
    + r")\.lora_([AB])\.weight"
)
# The parts of an image-text model outside its language model, which adapters are not served
# over (a CLIP tower's layers would otherwise read as the language model's).
_VISION = re.compile(r"(?:^|\.)(?:vision_tower|vision_model|visual|multi_modal_projector)\.")
# A hub repository id, `owner/name`.
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Settings that make the adapter compute something else than plain LoRA where they are set
# (plain LoRA leaves each false, null or empty).
_NOT_PLAIN = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "alpha_pattern",
    "layer_replication",
    "trainable_token_indices",
    "alora_invocation_tokens",
)


class LoRAError(ValueError):
    """An adapter that cannot be served, and why."""


# `(in_features, out_features)` of each target projection of one layer.
Shapes = dict[str, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One projection's adapter: `a` `[r, in]`, `b` `[out, r]` already scaled."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """An adapter's weights by `(layer index, projection name)`, on the host in fp32, and the
    projections they target (read by every step that runs the adapter)."""

    weights: dict[tuple[int, str], LoRAWeights]
    targets: frozenset[str]

    @property
    def rank(self) -> int:
        return max(pair.rank for pair in self.weights.values())


def load_adapter(path: str, layer_shapes: list[Shapes], max_rank: int) -> LoRAAdapter:
    """Read and check the adapter in folder `path` (or hub repository `path`) against the
    base model's layers."""
    folder = adapter_folder(path)
    if not (folder / CONFIG_FILE).is_file():
        raise LoRAError(f"no LoRA adapter at {path!r}: {CONFIG_FILE} not found")
    config = _read_config(folder / CONFIG_FILE)
    tensors = _read_tensors(folder)
    pairs = _pairs(tensors, len(layer_shapes))
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, name), (a, b) in sorted(pairs.items()):
        shape = layer_shapes[layer].get(name)
        if shape is None:
            raise LoRAError(
                f"layer {layer} has no {name} to adapt: adapters of a layer's attention and "
                "dense MLP are served, not of experts or of a recurrent mixer's own projections"
            )
        _check_shapes(layer, name, a, b, shape)
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(
                f"the adapter's rank {rank} is above --max-lora-rank {max_rank}; "
                "raise --max-lora-rank to serve it"
            )
        scale = _scale(config, rank)
        weights[layer, name] = LoRAWeights(a.float().contiguous(), (b.float() * scale).contiguous())
    if not weights:
        raise LoRAError(f"the adapter at {path!r} holds no LoRA weights of a layer's projection")
    return LoRAAdapter(weights, frozenset(name for _, name in weights))


def adapter_folder(path: str) -> Path:
    """The folder `path` names or, where there is none and `path` reads as a hub repository
    (`owner/name`), that repository's adapter files in the Hugging Face cache (`$HF_HOME`),
    fetched there first unless `HF_HUB_OFFLINE` is set, as vLLM resolves adapter paths."""
    folder = Path(path).expanduser()
    if folder.exists() or not _REPO.fullmatch(path):
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=path, allow_patterns=[CONFIG_FILE, *WEIGHT_FILES]))
    except Exception as exc:
        raise LoRAError(
            f"no LoRA adapter at {path!r}: no such folder, and the hub gave none ({exc})"
        ) from None


def _read_config(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{file} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{file} does not hold an object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAError(f"the adapter is {kind}, not LORA")
    for key in _NOT_PLAIN:
        if config.get(key):
            raise LoRAError(f"adapters with {key}={config[key]!r} are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapters with bias={config['bias']!r} are not supported")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise LoRAError(f"{file} needs a positive lora_alpha")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise LoRAError(f"{file} could not be read: {exc}") from None
    raise LoRAError(f"no adapter weights in {folder} (looked for {', '.join(WEIGHT_FILES)})")


def _pairs(
    tensors: dict[str, torch.Tensor], num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each targeted projection's (A, B); any other tensor is refused by name."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if _VISION.search(key):
            raise LoRAError(
                f"the adapter holds {key!r}, of the vision encoder: adapters of an image-text "
                "model's language model alone are served"
            )
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoRAError(
                f"the adapter holds {key!r}: only LoRA weights of the layers' projections "
                f"({', '.join(TARGETS)}) can be served"
            )
        layer = int(match.group(1))
        if layer >= num_layers:
            raise LoRAError(f"{key!r} names layer {layer}; the model has {num_layers} layers")
        name = ALIASES.get(match.group(2), match.group(2))
        found.setdefault((layer, name), {})[match.group(3)] = tensor
    pairs = {}
    for (layer, name), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"layer {layer}'s {name} has lora_A or lora_B but not both")
        pairs[layer, name] = (pair["A"], pair["B"])
    return pairs


def _check_shapes(
    layer: int, name: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int]
) -> None:
    in_features, out_features = shape
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise LoRAError(f"layer {layer}'s {name}: lora_A and lora_B do not make a low-rank pair")
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise LoRAError(
            f"layer {layer}'s {name} adapts a {a.shape[1]} -> {b.shape[0]} projection; "
            f"the model's is {in_features} -> {out_features} (an adapter of another model?)"
        )


def _scale(config: dict, rank: int) -> float:
    """PEFT's scale: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA."""
    alpha = float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
