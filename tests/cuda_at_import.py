"""A module that, imported where ``PARALLEL4D_TEST_CUDA_AT_IMPORT=1``, acts as one that initialises
CUDA at import (torch says CUDA is initialised): what the launcher's zygote must refuse to fork from.
Imported without the variable (the test process), it changes nothing."""

import os

import torch

if os.environ.get("PARALLEL4D_TEST_CUDA_AT_IMPORT") == "1":
    torch.cuda.is_initialized = lambda: True


def rank_zero() -> int:
    return 0
