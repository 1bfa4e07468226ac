"""A ``peft`` LoRA adapter directory's ``adapter_config.json`` ↔ the job's ``model.lora`` fields (standard
library only).

peft saves an adapter as ``adapter_config.json`` (its ``LoraConfig``) and ``adapter_model.safetensors``
(``base_model.model.<module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``). A job's
``model.lora.adapter: DIR`` starts from one, as ``PeftModel.from_pretrained(base, DIR, is_trainable=True)``
does: the adapter's own ``r``, ``lora_alpha``, ``target_modules`` and ``use_rslora`` are the adapter's
shape, so a ``model.lora`` that gives only ``adapter`` takes them from the file (:func:`lora_fields`), and one
that also gives ``rank``, ``alpha``, ``targets`` or ``rslora`` must agree (:func:`disagreements`: a refusal
naming the field, both values and the fix). ``lora_dropout`` is a training choice: filled from the file
when the job leaves ``model.lora.dropout`` unset, the job's own value kept otherwise.

An MoE model's routed experts are adapted as peft 0.21's conversion for transformers 5 adapts them: the
fused parameters ``mlp.experts.gate_up_proj`` / ``down_proj`` in ``target_parameters`` (peft moves the
``gate_proj``, ``up_proj``, ``down_proj`` a user names there for Qwen3-MoE), ``gate_up_proj`` at rank ``2r``
and alpha ``2·lora_alpha`` by ``rank_pattern`` / ``alpha_pattern`` (``FUSED_PATTERN``); read back as the
targets ``gate_proj``, ``up_proj`` (together) and ``down_proj``.

What the dense model cannot be is refused by name (:func:`lora_fields`): another ``peft_type``, DoRA,
trained biases, ``modules_to_save``, other per-module ranks (``rank_pattern`` / ``alpha_pattern``) and
``target_parameters``, layer subsets, a regular expression as ``target_modules``. :func:`adapter_config`
writes the file back (``parallel4d export --adapter``).
"""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: model.lora field → adapter_config.json key (the adapter's shape: a job's value must agree)
SHAPE_KEYS = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules", "rslora": "use_rslora"}
#: adapter_config.json keys whose non-default values the dense model's LoRA does not have, and what they mean
_UNSUPPORTED = {"use_dora": "DoRA (weight-decomposed adapters)", "modules_to_save": "modules trained whole",
                "layers_to_transform": "adapters on some layers only", "layers_pattern": "adapters on some layers only",
                "use_qalora": "QA-LoRA", "lora_bias": "a bias in lora_B", "exclude_modules": "excluded modules",
                "trainable_token_indices": "trained token rows"}
#: peft's fused expert parameters (transformers 5's ``mlp.experts.gate_up_proj`` / ``down_proj``) → the
#: ``model.lora.targets`` each stands for
EXPERT_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
#: the rank / alpha pattern key peft's conversion writes for a fused parameter of two projections
FUSED_PATTERN = r".*\.gate_up_proj"


def read_adapter_config(where: str) -> dict:
    """The ``adapter_config.json`` of adapter directory ``where``; ``ValueError`` saying what is wrong."""
    path = Path(where) / ADAPTER_CONFIG
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror or e}); point model.lora.adapter at a directory peft's "
                         f"save_pretrained wrote ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not peft's LoraConfig")
    return data


def lora_fields(peft_cfg: dict, path: str) -> dict:
    """``model.lora``'s fields (``rank``, ``alpha``, ``targets``, ``rslora``, ``dropout``) of peft's
    ``adapter_config.json`` dict (read from ``path``); ``ValueError`` for an adapter the dense model's LoRA
    cannot be, naming the key."""
    kind = peft_cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{path} is a {kind} adapter (peft_type); model.lora reads LoRA adapters only")
    used = [f"{key}={peft_cfg[key]!r} ({what})" for key, what in _UNSUPPORTED.items() if peft_cfg.get(key)]
    if peft_cfg.get("bias", "none") != "none":
        used.append(f"bias={peft_cfg['bias']!r} (trained biases)")
    if used:
        raise ValueError(f"{path} uses {', '.join(used)}, which model.lora does not have; save the adapter with "
                         "peft's plain LoRA (r, lora_alpha, target_modules, use_rslora, lora_dropout)")
    missing = [k for k in ("r", "lora_alpha") if k not in peft_cfg]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}; it is not a LoRA adapter peft saved")
    experts = _expert_targets(peft_cfg, path)
    targets = peft_cfg.get("target_modules")
    if isinstance(targets, str) or not (targets or experts):
        raise ValueError(f"{path} has target_modules={targets!r}: model.lora needs a list of module names "
                         "(q_proj, v_proj, …), not a regular expression; save the adapter with a list")
    return {"rank": peft_cfg["r"], "alpha": peft_cfg["lora_alpha"], "targets": sorted({*(targets or ()), *experts}),
            "rslora": bool(peft_cfg.get("use_rslora", False)), "dropout": peft_cfg.get("lora_dropout", 0.0)}


def _expert_targets(peft_cfg: dict, path: str) -> list[str]:
    """The ``model.lora.targets`` an adapter's ``target_parameters`` stand for: transformers 5's fused experts
    (``[mlp.experts.]gate_up_proj`` → gate_proj, up_proj; ``down_proj``), with ``gate_up_proj`` at rank ``2r`` and
    alpha ``2·lora_alpha`` (the ``rank_pattern`` / ``alpha_pattern`` peft's own conversion writes); ``ValueError``
    naming the key for any other parameter or pattern."""
    parameters = peft_cfg.get("target_parameters") or []
    if isinstance(parameters, str):
        parameters = [parameters]
    wrong = [p for p in parameters if p.rpartition(".")[2] not in EXPERT_PARAMETERS  # every layer's: a suffix
             or (p.rpartition(".")[0] and not ".mlp.experts".endswith("." + p.rpartition(".")[0]))]
    if wrong:
        raise ValueError(f"{path} has target_parameters={parameters!r}: model.lora adapts parameters only as an "
                         "MoE layer's fused experts (mlp.experts.gate_up_proj, mlp.experts.down_proj); save the "
                         "adapter with those or with target_modules")
    fused = {p.rpartition(".")[2] for p in parameters}
    wide = "gate_up_proj" in fused
    patterns = {"rank_pattern": {FUSED_PATTERN: 2 * peft_cfg["r"]} if wide else {},
                "alpha_pattern": {FUSED_PATTERN: 2 * peft_cfg["lora_alpha"]} if wide else {}}
    for key, want in patterns.items():
        if (peft_cfg.get(key) or {}) != want:
            raise ValueError(f"{path} has {key}={peft_cfg.get(key)!r}: model.lora has one rank and alpha, doubled "
                             f"on the experts' fused gate_up_proj only ({key}={want!r}, as peft's own conversion "
                             "writes it); save the adapter without other per-module ranks or alphas")
    return sorted(t for p in fused for t in EXPERT_PARAMETERS[p])


def disagreements(fields: dict, lora: dict, path: str) -> list[str]:
    """A refusal for each of the adapter's shape fields (:data:`SHAPE_KEYS`) that the job's ``model.lora``
    mapping ``lora`` gives with another value (targets as a set: peft stores them unordered)."""
    out = []
    for field, key in SHAPE_KEYS.items():
        if field not in lora:
            continue
        ours, theirs = lora[field], fields[field]
        same = sorted(ours) == theirs if field == "targets" and isinstance(ours, list) else ours == theirs
        if not same:
            out.append(f"model.lora.{field}={ours!r} but the adapter {path} has {key}={theirs!r}; remove "
                       f"model.lora.{field} (the adapter's is used) or start without model.lora.adapter")
    return out


def adapter_config(lora, base_name: str | None, fan_in_fan_out: bool, target_modules: list[str] | None = None,
                   expert_parameters: list[str] = ()) -> dict:
    """peft's ``adapter_config.json`` for ``model.lora`` section ``lora`` (``base_name``: what
    ``base_model_name_or_path`` records; ``fan_in_fan_out``: GPT-2's Conv1D), as ``LoraConfig`` saves it.
    An MoE model's: ``target_modules`` the names of the linears adapted (``lora.targets`` without it), and
    ``expert_parameters`` (``gate_up_proj``, ``down_proj``) the experts' fused parameters, written as peft's
    conversion for transformers 5 writes them — ``target_parameters``, ``gate_up_proj`` at rank ``2r`` and alpha
    ``2·alpha`` by ``rank_pattern`` / ``alpha_pattern``."""
    wide = "gate_up_proj" in expert_parameters
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
            "r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": sorted(lora.targets if target_modules is None else target_modules),
            "target_parameters": sorted(expert_parameters) or None,
            "rank_pattern": {FUSED_PATTERN: 2 * lora.rank} if wide else {},
            "alpha_pattern": {FUSED_PATTERN: 2 * lora.alpha} if wide else {},
            "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "fan_in_fan_out": fan_in_fan_out,
            "bias": "none", "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "use_dora": False}
