"""The optimizer section as torch objects: parameter groups and the learning-rate schedule
(``optimizer``), plain / torch-fused / apex kernels (``fused``) and float16's loss scale."""
