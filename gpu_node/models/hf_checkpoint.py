"""Loads a Hugging Face checkpoint directory: `config.json` into a ModelConfig
(models/families.py) and `*.safetensors` (one file or shards named by
`model.safetensors.index.json`) into our model classes.

Tensors are read lazily, shard by shard, each straight onto the target device
(safetensors maps the file; no full copy of the model is ever held in host memory),
cast to the compute dtype, and with `int4` every projection is quantized as it arrives,
so the full-precision weights of one tensor (one layer's experts for MoE) are the most
ever held at once.

A checkpoint that arrives quantized (GPTQ, AWQ, compressed-tensors: quant/checkpoint_formats.py)
is served as INT4 and only as INT4: its projections become Int4Linear (an MoE layer's
experts one Int4MoeExperts) straight from their codes, scales and zero points (no
dequantize-requantize), and a full-precision load of it is refused, since it would only
be those INT4 values dequantized.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.config import ModelConfig
from gpu_node.models.families import config_from_hf
from gpu_node.models.gemma3 import model_class
from gpu_node.models.llama import LlamaModel
from gpu_node.quant.checkpoint_formats import (
    ImportedLinear,
    QuantizedModules,
    quantized_format,
    stack_experts,
)
from gpu_node.quant.int4 import Int4Weight, quantize_int4
from gpu_node.quant.linear import Int4Linear

if TYPE_CHECKING:
    from gpu_node.models.moe import SharedExperts

Progress = Callable[[int, int], None]  # (tensors done, tensors total)

# The group size of INT4 on load (what GPTQ/AWQ checkpoints use most); layers whose
# input width it does not divide take the largest of these that does.
INT4_GROUP_SIZES = (128, 64, 32)

# Checkpoint names -> ours: the language model's prefix goes (Gemma 3's multimodal
# checkpoints keep theirs under language_model); vision towers are not loaded.
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIPPED = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
            "model.multi_modal_projector.", "language_model.lm_head.")  # fmt: skip
_EXPERT = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_EXPERT_MODULE = re.compile(
    r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)"
)
_FUSED_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")
_ROUTER_MODULE = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate")
_SHARED_EXPERTS = re.compile(
    r"layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight"
)
_EXPERT_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class HFCheckpoint:
    """An opened checkpoint directory. ModelNotFoundError when it is not one we can read."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(f"{self.path} has no config.json")
        try:
            self.raw_config: dict[str, Any] = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"{config_path} is not readable JSON: {exc}") from exc
        self.shards = self._shards()

    def _shards(self) -> dict[Path, list[str]]:
        """Each safetensors file and the tensors it holds."""
        from safetensors import safe_open

        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            shards: dict[Path, list[str]] = defaultdict(list)
            for name, file in weight_map.items():
                shards[self.path / file].append(name)
            missing = [str(p.name) for p in shards if not p.is_file()]
            if missing:
                raise ModelNotFoundError(f"{self.path}: shards missing: {', '.join(missing)}")
            return dict(shards)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"{self.path} holds no .safetensors weights")
        out: dict[Path, list[str]] = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                out[path] = list(f.keys())
        return out

    @property
    def quantization(self) -> dict[str, Any] | None:
        return self.raw_config.get("quantization_config")

    def config(self) -> ModelConfig:
        if self.quantization is not None:
            quantized_format(self.quantization)  # refuses a format that does not map
        return config_from_hf(self.raw_config)

    def quantized_modules(self) -> QuantizedModules | None:
        """The collector of the checkpoint's quantized projections; None if it has none."""
        if self.quantization is None:
            return None
        names = [our_name(n) for names in self.shards.values() for n in names]
        fmt = quantized_format(self.quantization)
        return QuantizedModules(fmt, [n for n in names if n is not None])

    def tensors(self, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, tensor on `device`) one at a time, shard by shard; None-named tensors
        (vision towers) are skipped."""
        from safetensors import safe_open

        for file, names in self.shards.items():
            with safe_open(file, framework="pt", device=str(torch.device(device))) as f:
                for name in names:
                    ours = our_name(name)
                    if ours is not None:
                        yield ours, f.get_tensor(name)

    @property
    def num_tensors(self) -> int:
        return sum(len(names) for names in self.shards.values())


def our_name(name: str) -> str | None:
    if name.startswith(_SKIPPED):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def int4_group_size(in_features: int) -> int | None:
    return next((g for g in INT4_GROUP_SIZES if in_features % g == 0), None)


def load_hf_model(
    checkpoint: HFCheckpoint,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    int4: bool = False,
) -> LlamaModel:
    """Our model of the checkpoint's family, computing in `dtype` on `device`; with `int4`
    every projection (attention, MLP, experts) quantized on load (RTN, INT4_GROUP_SIZES),
    embeddings, norms, routers and the output head kept in `dtype`. A quantized checkpoint
    takes `int4` (see the module docstring); its quantized projections are imported, any
    others kept in `dtype` as the checkpoint has them."""
    config = checkpoint.config()
    imported = checkpoint.quantized_modules()
    if imported is not None:
        _check_importable(checkpoint, config, imported, int4)
    quantize = int4 and imported is None  # a quantized checkpoint's other weights stay as they are
    with torch.device("meta"):
        model = model_class(config)(config)
    experts = _ExpertStacks(model, config, dtype, quantize)
    norms_offset = config.architecture == "gemma3"  # Gemma stores norm weights as w - 1
    state: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor] = {}
    total = checkpoint.num_tensors
    for done, (name, tensor) in enumerate(checkpoint.tensors(device), start=1):
        if imported is not None and imported.owns(name):
            linear = imported.add(name, tensor)  # None until the module's last tensor
            if linear is not None and not experts.take_int4(linear):
                bias = None if linear.bias is None else linear.bias.to(dtype)
                model.set_submodule(linear.name, Int4Linear(linear.weight, bias))
        elif experts.take(name, tensor):
            pass
        elif config.tie_word_embeddings and name == "lm_head.weight":
            pass  # the embedding's, tied below
        elif name.endswith("norm.weight") and norms_offset:
            state[name] = (tensor.float() + 1.0).to(dtype)
        elif quantize and _is_projection(name) and name.endswith(".weight"):
            _quantize_into(model, name.removesuffix(".weight"), tensor, dtype)
        elif quantize and _is_projection(name) and name.endswith(".bias"):
            biases[name] = tensor.to(dtype)
        else:
            state[name] = tensor.to(dtype)
        if progress:
            progress(done, total)
    experts.finish()
    if imported is not None:
        imported.finish()
    for name, bias in biases.items():
        module = model.get_submodule(name.removesuffix(".bias"))
        module.bias = nn.Parameter(bias, requires_grad=False)
    if config.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    unexpected = set(state) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if unexpected:
        raise ModelNotFoundError(
            f"{checkpoint.path}: tensors we do not know: {', '.join(sorted(unexpected)[:5])}"
        )
    model.load_state_dict(state, assign=True, strict=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rotary_tables(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelNotFoundError(f"{checkpoint.path}: weights missing for {', '.join(left[:5])}")
    return model.eval()


def _check_importable(
    checkpoint: HFCheckpoint, config: ModelConfig, imported: QuantizedModules, int4: bool
) -> None:
    method = imported.format.method
    if not int4:
        raise ModelNotFoundError(
            f"{checkpoint.path} is quantized ({method} INT4): serve it with --weights int4; "
            f"a full-precision copy would only be its INT4 values dequantized"
        )
    if any(_ROUTER_MODULE.fullmatch(module) for module in imported.modules):
        raise ModelNotFoundError(f"{checkpoint.path}: quantized MoE routers are not imported")
    if config.tie_word_embeddings and "lm_head" in imported.modules:
        raise ModelNotFoundError(
            f"{checkpoint.path}: lm_head is quantized but tied to the embedding, which is not"
        )


def _is_projection(name: str) -> bool:
    module = name.rsplit(".", 1)[0]
    return module.rsplit(".", 1)[-1].endswith("_proj")


def _quantize_into(
    model: nn.Module, module_name: str, weight: torch.Tensor, dtype: torch.dtype
) -> None:
    group = int4_group_size(weight.shape[1])
    if group is None:  # no group size divides its width: it stays in the compute dtype
        linear = model.get_submodule(module_name)
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None,
                          device=weight.device, dtype=dtype)  # fmt: skip
        dense.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        model.set_submodule(module_name, dense)
        return
    model.set_submodule(module_name, Int4Linear(quantize_int4(weight.float(), group)))


class _ExpertStacks:
    """Collects each MoE layer's router and experts as they stream in; a layer's MoeMLP
    is built (and quantized) as soon as its last tensor arrives."""

    def __init__(self, model: LlamaModel, config: ModelConfig, dtype: torch.dtype, int4: bool):
        self.model, self.config, self.dtype, self.int4 = model, config, dtype, int4
        self.parts: dict[int, dict[str, Any]] = defaultdict(dict)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        if self.config.moe is None:
            return False
        if m := _EXPERT.fullmatch(name):
            layer, expert, part = int(m[1]), int(m[2]), _EXPERT_PART.get(m[3], m[3])
            self.parts[layer][f"{part}.{expert}"] = tensor.to(self.dtype)
        elif m := _FUSED_EXPERTS.fullmatch(name):
            self.parts[int(m[1])][m[2]] = tensor.to(self.dtype)
        elif m := _ROUTER.fullmatch(name):
            self.parts[int(m[1])]["router"] = tensor.float()
        elif m := _SHARED_EXPERTS.fullmatch(name):
            self.parts[int(m[1])][f"shared.{m[2]}"] = tensor.to(self.dtype)
        else:
            return False
        self._build_if_complete(int(m[1]))
        return True

    def take_int4(self, linear: ImportedLinear) -> bool:
        """An expert's projection imported from a quantized checkpoint."""
        if self.config.moe is None or not (m := _EXPERT_MODULE.fullmatch(linear.name)):
            return False
        if linear.bias is not None:
            raise ModelNotFoundError(f"{linear.name}: experts with a bias are not supported")
        layer, expert, part = int(m[1]), int(m[2]), _EXPERT_PART.get(m[3], m[3])
        self.parts[layer][f"{part}.{expert}"] = linear.weight
        self._build_if_complete(layer)
        return True

    def _build_if_complete(self, layer: int) -> None:
        from gpu_node.models.moe import Int4MoeExperts, MoeMLP, Router

        moe, parts = self.config.moe, self.parts[layer]
        assert moe is not None
        n = moe.num_experts
        shared = [f"shared.{p}" for p in _EXPERT_PROJECTIONS] if moe.num_shared_experts else []
        fused = "gate_up_proj" in parts and "down_proj" in parts
        routed = len(parts) - 1 - len(shared)
        if "router" not in parts or any(s not in parts for s in shared):
            return
        if not (fused or routed == 3 * n):
            return
        per_expert = (
            [] if fused else [parts[f"{p}.{e}"] for p in _EXPERT_PROJECTIONS for e in range(n)]
        )
        experts: nn.Module
        if per_expert and all(isinstance(w, Int4Weight) for w in per_expert):
            gate, up, down = per_expert[:n], per_expert[n : 2 * n], per_expert[2 * n :]
            experts = Int4MoeExperts(*stack_experts(gate, up, down))
        elif any(isinstance(w, Int4Weight) for w in per_expert):
            raise ModelNotFoundError(f"MoE layer {layer}: only some experts are quantized")
        else:
            experts = self._experts(parts, n, fused)
        shared_experts = self._shared_experts(*(parts[s] for s in shared)) if shared else None
        mlp = MoeMLP(moe, Router(moe, parts["router"]), experts, shared_experts)
        self.model.layers[layer].mlp = mlp
        del self.parts[layer]

    def _experts(self, parts: dict[str, Any], n: int, fused: bool) -> nn.Module:
        from gpu_node.models.moe import MoeExperts

        if fused:  # [E, 2I, H] (gate rows, then up rows) and [E, H, I]
            w13, w2 = parts["gate_up_proj"], parts["down_proj"]
        else:
            gate = torch.stack([parts[f"gate_proj.{e}"] for e in range(n)])  # [E, I, H]
            up = torch.stack([parts[f"up_proj.{e}"] for e in range(n)])
            w13 = torch.cat([gate, up], dim=1)
            w2 = torch.stack([parts[f"down_proj.{e}"] for e in range(n)])  # [E, H, I]
        if self.int4:
            group = int4_group_size(min(w13.shape[2], w2.shape[2]))
            if group is not None:
                return MoeExperts(w13.float(), w2.float()).to_int4(group)
        return MoeExperts(w13, w2)

    def _shared_experts(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> SharedExperts:
        """The shared experts as one SwiGLU MLP (DeepSeek's `shared_experts`), each of its
        projections quantized on load like any other."""
        from gpu_node.models.moe import SharedExperts

        shared = SharedExperts(gate, up, down)
        if self.int4:
            for name in ("gate_proj", "up_proj", "down_proj"):
                _quantize_into(shared, name, getattr(shared, name).weight.data, self.dtype)
        return shared

    def finish(self) -> None:
        if self.parts:
            layers = ", ".join(str(i) for i in sorted(self.parts))
            raise ModelNotFoundError(f"MoE layers {layers}: experts or router missing")
