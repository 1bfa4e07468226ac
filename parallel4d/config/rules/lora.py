"""Low-rank adapter rules (``model.lora``): targets the family has, and the layouts adapters do not run
in yet (one process, or hetero with ZeRO over parallel.dp, for now: the other parallel axes, DeepSpeed, compile and
MoE layers come later).

Torch-free; ``config/checks.py`` calls :func:`problems` among the cross-field rules with the family's
peft target names (its spec's ``lora_targets``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parallel4d.config.rules.common import did_you_mean

if TYPE_CHECKING:  # annotations only: the schema imports the rules
    from parallel4d.config.schema import Config


def target_problems(cfg: Config, valid: tuple[str, ...]) -> list[str]:
    """Each of ``model.lora.targets`` one of the family's peft ``target_modules`` names (``valid``)."""
    lora, arch = cfg.model.lora, cfg.model.arch
    out = []
    for name in dict.fromkeys(lora.targets):
        if name not in valid:
            out.append(f"model.lora.targets names {name!r}, not a linear layer of model.arch={arch}; "
                       f"{did_you_mean(name, valid)}use peft's target_modules names of the family: "
                       f"{', '.join(valid)}")
    if len(set(lora.targets)) < len(lora.targets):
        out.append(f"model.lora.targets={lora.targets} names a layer twice; name each once")
    return out


def layout_problems(cfg: Config) -> list[str]:
    """What adapters do not run in yet: any parallel axis above 1 (but parallel.dp under hetero), a deepspeed: section,
    ``train.compile``, MoE layers, an adapter directory to start from (each a later part of issue 49)."""
    p, m = cfg.parallel, cfg.model
    # under hetero the data replicas are ZeRO's (its chunks reduce the adapters' gradients; the base has none)
    wider = [f"parallel.{axis}={getattr(p, axis)}" for axis in ("pp", "dp", "sp", "tp", "ep")
             if getattr(p, axis) > 1 and not (axis == "dp" and cfg.hetero.enabled)]
    beside = wider + [f for f, on in (("a deepspeed: section", cfg.deepspeed is not None),
                                      (f"train.compile={cfg.train.compile}", cfg.train.compile != "none"),
                                      (f"model.num_experts={m.num_experts}", m.num_experts > 0)) if on]
    out = []
    if beside:
        out.append(f"model.lora (low-rank adapters) runs in one process for now, not with {', '.join(beside)}; "
                   "set every parallel size to 1 (parallel.dp may stay with hetero.enabled=true), train.compile=none, "
                   "no deepspeed: section and a dense model, or remove model.lora")
    if m.lora.adapter is not None:
        out.append(f"model.lora.adapter={m.lora.adapter!r}: starting from a peft adapter directory is not read yet; "
                   "remove model.lora.adapter (the adapters start as peft initialises them)")
    return out


def problems(cfg: Config, valid: tuple[str, ...]) -> list[str]:
    """``model.lora``'s rules (none without it)."""
    if cfg.model.lora is None:
        return []
    return target_problems(cfg, valid) + layout_problems(cfg)


def _linears(m) -> dict[str, list[tuple[int, int]]]:
    """Per peft target name, the ``(in, out)`` of each linear of one layer it names (GPT-2's ``c_proj`` is
    two: the attention's and the MLP's; its ``c_attn`` one fused q, k, v)."""
    attn, kv = m.heads * m.head_size, m.kv_heads_or_heads * m.head_size
    h, w = m.hidden, m.mlp_width
    return {"q_proj": [(h, attn)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(attn, h)],
            "gate_proj": [(h, w)], "up_proj": [(h, w)], "down_proj": [(w, h)],
            "c_attn": [(h, 3 * h)], "c_proj": [(h, h), (w, h)], "c_fc": [(h, w)]}


def adapter_parameters(m) -> int:
    """Elements of the adapters ``model.lora`` adds to the model ``m`` (0 without it): ``rank·(in + out)``
    per targeted linear (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``), every layer."""
    if m.lora is None:
        return 0
    shapes = _linears(m)
    per_layer = sum(i + o for t in dict.fromkeys(m.lora.targets) for i, o in shapes.get(t, ()))
    return m.lora.rank * per_layer * m.layers
