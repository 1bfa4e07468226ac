"""This rank's model as the engine holds it: its stages under their dense names
(:class:`LocalModel`, a sequence shard's embedding :class:`PositionedEmbedding`), and the
dtype and shape a config asks for."""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel4d.config.rules import hetero as hetero_rules
from parallel4d.config.schema import Config
from parallel4d.models.build import Shape, shape_from_config

# train.dtype → the dtype parameters are kept in (and, under autocast, pipeline activations cross ranks in);
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


def parameter_dtype(cfg: Config) -> torch.dtype:
    """The parameters' dtype (``train.param_dtype``, or what the ``train.dtype`` preset implies)."""
    return TORCH_DTYPES[cfg.train.parameters]


def pipeline_activation_dtype(cfg: Config) -> torch.dtype:
    """The dtype activations and their gradients cross pipeline stages in: the autocast dtype under
    autocast (what the stages' matmuls compute in: bf16/fp16 halve the bytes sent), else the dtype
    the parameters compute in (hetero's chunks', or the parameters')."""
    if cfg.train.autocast != "none":
        return TORCH_DTYPES[cfg.train.autocast]
    return TORCH_DTYPES[hetero_rules.compute_dtype(cfg)] if cfg.hetero.enabled else parameter_dtype(cfg)


def tf32_allowed(cfg: Config, device: torch.device | str) -> bool | None:
    """Whether this process's float32 matmuls and cuDNN kernels may use TensorFloat-32 on ``device``:
    ``train.tf32`` where float32 compute happens (float32 parameters: the float32, bfloat16 and
    float16 presets; float64 never rounds through TF32); None off CUDA (nothing to set)."""
    if torch.device(device).type != "cuda":
        return None
    return cfg.train.tf32 and cfg.train.parameters == "float32"


def use_tf32(allowed: bool | None) -> None:
    """Set this process's cuBLAS and cuDNN TF32 switches to ``allowed`` (None: leave them). Called
    where a worker sets up its device, never at import: the switches are per process."""
    if allowed is None:
        return
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


def model_shape(cfg: Config) -> Shape:
    """The model's shape: ``model.*`` for its ``arch``, plus ``sequence.causal`` (masked or
    bidirectional attention, in the dense blocks as in the ring and the 2D blocks)."""
    return shape_from_config(cfg.model, causal=cfg.sequence.causal)


class PositionedEmbedding(nn.Module):
    """An embedding stage fed the *global* position ids of this rank's sequence shard."""

    def __init__(self, embed: nn.Module, positions: torch.Tensor):
        super().__init__()
        self.embed = embed
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, tokens):
        return self.embed(tokens, self.positions)


class LocalModel(nn.Module):
    """This rank's stages under their dense names (``embed``, ``blocks.<i>``, ``head``)."""

    def __init__(self, stages: dict[str, nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict()
        for name, module in stages.items():
            if name.startswith("blocks."):
                self.blocks[name.split(".", 1)[1]] = module
            else:
                self.add_module(name, module)

    def dense_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(dense name, parameter)`` of each parameter once (the optimizer's groups go by these);
        needs ``.dense``, which :func:`~parallel4d.engine.compose.local_model` sets."""
        return [(self.dense[n][0], p) for n, p in self.named_parameters()]

    def stages(self) -> dict[str, nn.Module]:
        """``{dense stage name: module}`` in model order (the input of
        :func:`~parallel4d.engine.state.dense_layouts`)."""
        named = {n: m for n, m in self.named_children() if n != "blocks"}
        blocks = {f"blocks.{k}": m for k, m in self.blocks.items()}
        return {**({"embed": named.pop("embed")} if "embed" in named else {}), **blocks, **named}


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters on this rank (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
