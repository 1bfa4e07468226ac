"""The process-group layer: collective and point-to-point helpers with timeouts and byte
counters (``comm``), the named-axis ``Mesh`` (``mesh``), the process group's start-up under
torchrun (``elastic``) and the data-parallel gradient buckets (``ddp``)."""
