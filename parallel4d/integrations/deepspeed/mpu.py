"""A mesh as DeepSpeed's model-parallel unit: ``deepspeed.initialize(..., mpu=as_mpu(mesh))``.

DeepSpeed is not imported here: it probes the object it is given for these methods.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from parallel4d.distributed.mesh import Mesh


def as_mpu(mesh: Mesh) -> "MeshMPU":
    """``mesh`` as the model-parallel unit ``deepspeed.initialize(mpu=...)`` expects (collective: it
    creates the groups over several axes)."""
    return MeshMPU(mesh)


class MeshMPU:
    """The duck-typed ``mpu`` DeepSpeed probes with ``hasattr`` (DeepSpeed is not imported).

    * data parallel = ``dp``; sequence-data parallel = ``dp·sp``, the group ZeRO partitions
      over and reduces gradients in (DeepSpeed averages over dp and sums over sp, so a
      rank's loss is its token sum over the global token count);
    * model parallel = every axis holding distinct parameters: ``pp × tp_row × tp_col``
      (gradient norms and overflow flags are summed over it); tensor parallel = the q×q grid;
      pipeline = ``pp``; sequence = ``sp``.

    No ``initialize_sequence_parallel``: with it DeepSpeed would take this for its Ulysses
    mpu and drop the data- and model-parallel groups.
    """

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        # groups over several axes are created collectively: here, in one order on every rank,
        # not in whatever order DeepSpeed first asks for them
        for axes in (("dp", "sp"), ("pp", "tp_row", "tp_col"), ("tp_row", "tp_col")):
            mesh.group_over(*axes)

    def _over(self, *axes: str) -> tuple[dist.ProcessGroup, int, int]:
        return self.mesh.group_over(*axes), math.prod(self.mesh.size(a) for a in axes), self.mesh.rank_over(*axes)

    # data
    def get_data_parallel_group(self):
        return self._over("dp")[0]

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.size("dp")

    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.mesh.ranks_along("dp")

    # sequence, and the data replicas ZeRO shards over
    def get_sequence_parallel_group(self):
        return self._over("sp")[0]

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.size("sp")

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.rank("sp")

    def get_sequence_data_parallel_group(self):
        return self._over("dp", "sp")[0]

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._over("dp", "sp")[1]

    def get_sequence_data_parallel_rank(self) -> int:
        return self._over("dp", "sp")[2]

    # model parallel: every axis with distinct parameters
    def get_model_parallel_group(self):
        return self._over("pp", "tp_row", "tp_col")[0]

    def get_model_parallel_world_size(self) -> int:
        return self._over("pp", "tp_row", "tp_col")[1]

    def get_model_parallel_rank(self) -> int:
        return self._over("pp", "tp_row", "tp_col")[2]

    # tensor parallel: the q×q grid
    def get_tensor_model_parallel_group(self):
        return self._over("tp_row", "tp_col")[0]

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._over("tp_row", "tp_col")[1]

    def get_tensor_model_parallel_rank(self) -> int:
        return self._over("tp_row", "tp_col")[2]

    # pipeline
    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.mesh.size("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.mesh.rank("pp")
