"""What a model family is, without torch: :class:`ModelSpec` (one per family, in ``models/<family>/spec.py``).

A spec holds everything about a family that the configuration needs: its ``model.arch`` name, the
``model:`` fields it reads, its rules, its Hugging Face ``model_type`` values and the mapping of their
``config.json`` both ways, its tensor names in a Hugging Face checkpoint, its parameter count, its
training FLOPs per token and its usual shapes. A spec module imports only the standard library, this module and
:mod:`parallel4d.config.rules` (pure), so :mod:`parallel4d.config` can import the registry
(:mod:`.registry`) without torch. The
family's torch side (dense model, 2D twin) is the module :attr:`ModelSpec.torch_module` names;
:mod:`.build` imports it.

Every callable takes the job's ``config.ModelConfig`` (``m``); none imports the schema (it imports
the registry), so the annotations say ``ModelConfig`` under ``TYPE_CHECKING`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # annotations only: the schema imports the registry of specs
    from parallel4d.config.schema import ModelConfig

# Hugging Face name → (dense name, transform): "copy"; "t" (a Conv1D weight [in, out] → nn.Linear's
# [out, in]).
NameMap = dict[str, tuple[str, str]]


@dataclass(frozen=True)
class ModelSpec:
    """One model family (``model.arch``), torch-free. See the module doc; each callable's ``m`` is a
    ``config.ModelConfig`` of this family."""

    name: str  # the model.arch value
    summary: str  # one line for the arch field's description
    torch_module: str  # the module holding the family's torch side (its ``FAMILY``, a build.Family)
    hf_model_types: tuple[str, ...]  # config.json model_type values that load as this family
    fields: tuple[str, ...]  # the model: fields this family reads (``parallel4d validate`` shows these)
    learned_positions: bool  # a table of max_positions (else seq_len) positions: part of the tensor shapes
    problems: Callable[[ModelConfig, int], list[str]]  # (m, q): the family's rules, one message each
    dense_parameters: Callable[[ModelConfig], int]  # about how many parameters (norms, biases left out)
    flops_per_token: Callable[[ModelConfig], float]  # training (forward + backward) FLOPs per token
    stage_flops: Callable[[ModelConfig], list[float]]  # the same per stage [embed, blocks…, head]: the pipeline's cut
    fields_from_hf: Callable[[dict], dict]  # config.json → model: fields (ValueError for what cannot load)
    hf_config: Callable[[ModelConfig, dict], dict]  # (m, the keys every family writes) → config.json
    hf_names: Callable[[ModelConfig], NameMap]  # dense name → (Hugging Face name, transform), no lm_head
    hf_positions: str  # the config.json key of the positions the checkpoint holds or was trained for
    hf_prefix: str = ""  # a prefix of every name that some checkpoints leave out (gpt2: "transformer.")
    hf_ignored: tuple[str, ...] = ()  # name suffixes of tensors that are not weights (buffers)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # this family's defaults of shared fields
    resolved: Callable[[ModelConfig], dict] = lambda m: {}  # shown values for fields whose None means more
    # the family's usual shapes (model: fields), each with more parameters than the one before: the
    # widths ``parallel4d plan --largest`` grows a model through
    shapes: tuple[Mapping[str, int], ...] = ()
    # peft's target_modules names of this family's linears (model.lora.targets): the last component of
    # a linear's Hugging Face module name
    lora_targets: tuple[str, ...] = ()

    def shown(self, m: ModelConfig) -> dict:
        """The ``model:`` section as ``validate`` prints it: this family's fields only (in the schema's
        order), those whose unset value stands for another with that value."""
        dump = m.model_dump(mode="json")
        return {**{k: v for k, v in dump.items() if k in self.fields}, **self.resolved(m)}


def training_flops(matmul_parameters: int, layers: int, seq_len: int, attention_width: int) -> float:
    """FLOPs per token of one forward and backward: 2 per weight of a matrix product forward, 4
    backward (input and weight gradients), so ``6·N`` over the ``N`` weights of the matrix products
    (the LM head included, embeddings looked up, not multiplied); plus the attention's own products,
    ``q·kᵀ`` and ``p·v`` over the whole sequence (``2·2·s·width`` forward, twice that backward, per
    layer). Norms, activations and softmax are left out: that is what torch's ``FlopCounterMode``
    counts (the full ``s×s`` scores, also for causal attention)."""
    return 6 * matmul_parameters + 12 * layers * seq_len * attention_width


def stage_training_flops(block_matrices: int, head_matrix: int, layers: int, seq_len: int,
                         attention_width: int) -> list[float]:
    """:func:`training_flops` per pipeline stage ``[embedding, block_0 … block_{L-1}, LM head]`` (they sum
    to it): the embedding looks rows up (0), a block is ``6·(its matrices' weights) + 12·s·width``, the LM
    head ``6·V·h`` (``head_matrix`` weights). What each stage costs to train, whatever it holds: the
    embedding's table weighs nothing here, the head's ``V·h`` weighs as much as its products."""
    block = 6 * block_matrices + 12 * seq_len * attention_width
    return [0.0] + [float(block)] * layers + [float(6 * head_matrix)]


def refuse(model_type: str, what: str) -> None:
    """``ValueError``: a checkpoint of ``model_type`` has a feature the dense model lacks."""
    raise ValueError(f"Hugging Face model_type {model_type!r}: {what}")


def need(config: dict, key: str):
    """``config[key]``; ``ValueError`` naming the key when it is missing or null."""
    if config.get(key) is None:
        raise ValueError(f"Hugging Face model_type {config.get('model_type')!r}: config.json lacks {key!r}")
    return config[key]
