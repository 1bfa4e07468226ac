"""LoRA adapters in and out in ``peft``'s format, and the merged model (``model.lora``; the hf extra).

* :func:`load_adapter`: ``model.lora.adapter``'s ``adapter_model.safetensors`` into this rank's adapters,
  each rank reading only its pieces (``get_slice``), as ``model.pretrained`` is read.
* :func:`write_adapter`: the adapters as ``PeftModel.save_pretrained`` writes them (``adapter_config.json``
  + ``adapter_model.safetensors``, names ``base_model.model.<module>.lora_A.weight``), which
  ``PeftModel.from_pretrained(base, DIR)`` loads onto the original base (``parallel4d export --adapter``).
* :class:`MergedSource`: base + adapters as the dense tensors of a plain model — each targeted weight
  ``W + scaling · B·A`` (``W`` ``[out, in]``, the dense layout; GPT-2's Conv1D is transposed on writing as
  every GPT-2 weight is, so its merged ``[in, out]`` is ``Wᵀ + scaling·(B·A)ᵀ``, peft's ``fan_in_fan_out``
  merge) — read a block of rows at a time, which :func:`~parallel4d.models.hf.save_hf` writes
  (``parallel4d export``) and ``parallel4d generate`` runs.

The adapters' tensors in peft's file are ours as they are: ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``
for every family (:mod:`parallel4d.models.lora`); an MoE layer's routed experts' (stacked ``[E, r, in]`` /
``[E, out, r]``, one per fused parameter ``gate_up_proj`` / ``down_proj``) are peft's ``[E·r, in]`` /
``[out, r·E]`` (:func:`~parallel4d.models.lora.expert_tensor_to_peft`), its config's ``target_parameters``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallel4d.checkpoint.pretrained import check_adapter
from parallel4d.config.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPERT_PARAMETERS, adapter_config
from parallel4d.models.lora import (LoraShape, adapted_experts, adapted_modules, expert_peft_names, expert_shape,
                                    expert_tensor_from_peft, expert_tensor_to_peft, is_adapter, peft_names)


def adapter_pieces(model, layouts: dict) -> dict[str, tuple[tuple, list]]:
    """``{dense adapter name: (dense shape, [(offsets, view)])}``: this rank's pieces of every adapter of
    ``model`` (``layouts``: :func:`~parallel4d.engine.state.dense_layouts`)."""
    pieces: dict[str, tuple[tuple, list]] = {}
    for name, p in model.named_parameters():
        dense, shape, cut = layouts[name]
        if is_adapter(dense):
            pieces.setdefault(dense, (tuple(shape), []))[1].extend(cut(p.data))
    return pieces


def load_adapter(pieces: dict[str, tuple[tuple, list]], model_cfg) -> int:
    """Fill ``pieces`` (:func:`adapter_pieces`) from peft's ``adapter_model.safetensors`` in ``model.lora.adapter``,
    reading only those slices (a routed expert's adapter: the rank's experts' rows of ``lora_A`` and columns of
    ``lora_B``, :func:`_expert_box`); the bytes read. ``ConfigError`` naming the file and tensor for a tensor
    missing, of another shape, or one the model has no adapter for (:func:`check_adapter`)."""
    from safetensors import safe_open  # the hf extra

    check_adapter(model_cfg)
    names, experts = peft_names(adapted_modules(model_cfg)), expert_peft_names(model_cfg)
    read = 0
    with safe_open(str(Path(model_cfg.lora.adapter).expanduser() / ADAPTER_WEIGHTS), framework="pt") as f:
        for dense, (shape, boxes) in pieces.items():
            for offsets, view in boxes:
                if dense in experts:
                    t = _expert_box(f.get_slice(experts[dense]), dense.rsplit(".", 1)[-1], offsets, view.shape,
                                    shape[0])
                else:
                    t = f.get_slice(names[dense])[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))]
                read += t.numel() * t.element_size()
                with torch.no_grad():
                    view.copy_(t)
    return read


def _expert_box(stored, part: str, offsets, shape, experts: int) -> torch.Tensor:
    """The box ``offsets`` + ``shape`` of our stacked expert adapter tensor (``lora_A`` ``[E, r, in]``,
    ``lora_B`` ``[E, out, r]``) read from peft's (``stored``, a safetensors slice: ``[E·r, in]`` expert-major
    rows; ``[out, r·E]``, column ``j·E + e`` expert ``e``'s ``j``-th), only the experts ``offsets[0]…`` of it."""
    (e0, i0, k0), (n, rows, cols) = offsets, shape
    if part == "lora_A":
        rank = stored.get_shape()[0] // experts
        t = stored[e0 * rank:(e0 + n) * rank, k0:k0 + cols]
        return expert_tensor_from_peft(part, t, n)[:, i0:i0 + rows]
    per_rank = [stored[i0:i0 + rows, j * experts + e0:j * experts + e0 + n] for j in range(k0, k0 + cols)]
    return torch.stack(per_rank, dim=1).permute(2, 0, 1)  # [out, r, n] → [n, out, r]


def write_adapter(out: Path, adapters: dict[str, torch.Tensor], model_cfg, base_name: str | None) -> None:
    """``adapters`` (``{dense adapter name: whole tensor}``) as peft's adapter directory in ``out``: the routed
    experts' in peft's layout (:func:`~parallel4d.models.lora.expert_tensor_to_peft`) and config (its
    ``target_parameters``, :func:`~parallel4d.config.peft_adapter.adapter_config`)."""
    from safetensors.torch import save_file  # the hf extra

    names, experts = peft_names(adapted_modules(model_cfg)), expert_peft_names(model_cfg)
    tensors = {}
    for dense, t in adapters.items():
        if dense in experts:
            tensors[experts[dense]] = expert_tensor_to_peft(dense.rsplit(".", 1)[-1], t.detach())
        else:
            tensors[names[dense]] = t.detach()
    tensors = {k: t.cpu().contiguous() for k, t in tensors.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(model_cfg.lora, base_name, fan_in_fan_out=model_cfg.arch == "gpt2",
                            **peft_targets(model_cfg))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def peft_targets(model_cfg) -> dict:
    """What peft's config names as adapted on ``model.lora``'s model: without routed experts adapted, the
    targets (``{}``: :func:`adapter_config`'s default); with them, ``target_modules`` the names of the linears
    adapted (an MoE model's may lack the MLP names: no dense or shared-expert MLP) and ``expert_parameters`` the
    experts' fused parameters."""
    fused = sorted({which for _, found in adapted_experts(model_cfg).values() for which in found})
    if not fused:
        return {}
    linears = sorted({hf.rsplit(".", 1)[-1] for hf in adapted_modules(model_cfg).values()})
    return {"target_modules": linears, "expert_parameters": fused}


#: the transformers model types whose ``target_modules`` peft 0.21 converts for transformers 5's fused experts
#: (``peft.utils.transformers_weight_conversion``): there ``gate_proj`` / ``up_proj`` / ``down_proj`` become the
#: routed experts' ``target_parameters`` only, on loading too, so no dense MLP layer's linear is adapted
PEFT_CONVERTED_TYPES = ("qwen3_moe", "mixtral")


def peft_problem(model_cfg, model_type: str) -> str | None:
    """Why peft could not load ``model.lora``'s adapters onto the exported ``model_type`` as they are: a
    dense MLP layer's (or shared expert's) linears adapted on a type whose MLP names peft moves to the routed
    experts (:data:`PEFT_CONVERTED_TYPES`); None when it can."""
    if model_type not in PEFT_CONVERTED_TYPES or not adapted_experts(model_cfg):
        return None
    names = {t for fused in EXPERT_PARAMETERS.values() for t in fused}  # gate_proj, up_proj, down_proj
    mlp = sorted(hf for hf in adapted_modules(model_cfg).values() if hf.rsplit(".", 1)[-1] in names)
    if not mlp:
        return None
    return (f"model.lora.targets={model_cfg.lora.targets} adapt the linears of dense MLP layers ({mlp[0]}, "
            f"{len(mlp)} in all) of a {model_type} model, which peft 0.21 leaves unadapted on loading (it moves "
            "gate_proj, up_proj and down_proj to the routed experts' target_parameters for that type), so the "
            "adapter would not load to the same model; export the merged model (without --adapter)")


class MergedSource:
    """The merged model's dense tensors (a :class:`~parallel4d.models.hf.DenseSource`): ``base``'s, each
    adapted weight plus ``scaling · B·A`` (in float64, cast to the base's dtype). ``adapters``: ``{dense
    adapter name: whole tensor}`` (:func:`~parallel4d.models.lora.adapter_names`; small: ``r·(in + out)`` per
    module, ``E`` times that per MoE layer's experts).

    An MoE layer's routed experts (stacked ``….experts.gate_proj`` / ``up_proj`` ``[E, I, h]``, ``down_proj``
    ``[E, h, I]``, read an expert or a few at a time) get each expert's ``scaling · B_e·A_e``: ``down_proj``'s
    adapter whole, ``gate_up_proj``'s (rank ``2r``, over the fused ``[gate; up]`` rows ``[2I, h]``) its first
    ``I`` rows of ``B_e`` for the gate, the last ``I`` for the up projection — the weights the adapted forward
    uses (:meth:`~parallel4d.models.moe.layer.Experts.adapted`)."""

    def __init__(self, base, adapters: dict[str, torch.Tensor], model_cfg):
        lora = LoraShape.of(model_cfg.lora)
        self.base, self.scaling = base, lora.scaling
        self.pairs = {f"{m}.weight": (adapters[f"{m}.lora_A"], adapters[f"{m}.lora_B"])
                      for m in adapted_modules(model_cfg)}
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor, float, slice]] = {}
        for module, (_, fused) in adapted_experts(model_cfg).items():
            for which in fused:
                a, b = (adapters[f"{module}.adapters.{which}.{part}"] for part in ("lora_A", "lora_B"))
                scaling = expert_shape(lora, which).scaling
                if which == "down_proj":
                    self.experts[f"{module}.down_proj"] = a, b, scaling, slice(None)
                    continue
                width = base.shapes[f"{module}.gate_proj"][0][1]
                self.experts[f"{module}.gate_proj"] = a, b, scaling, slice(0, width)
                self.experts[f"{module}.up_proj"] = a, b, scaling, slice(width, 2 * width)
        self.shapes = {k: v for k, v in base.shapes.items() if not is_adapter(k)}

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        rows = self.base.read(name, start, stop)
        if name in self.experts:  # experts start..stop: [n, out, in] plus each one's [out, in] product
            a, b, scaling, out_rows = self.experts[name]
            delta = torch.bmm(b[start:stop, out_rows].double(), a[start:stop].double()) * scaling
            return (rows.double() + delta).to(rows.dtype)
        if name not in self.pairs:
            return rows
        a, b = self.pairs[name]
        delta = b[start:stop].double() @ a.double() * self.scaling
        return (rows.double() + delta).to(rows.dtype)
