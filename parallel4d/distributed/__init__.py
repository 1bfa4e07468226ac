"""The process-group layer: collective and point-to-point helpers with timeouts and byte
counters (``comm``), the named-axis ``Mesh`` (``mesh``), joining the process group (``startup``: device
and backend, torchrun's env://) in a store of the restart attempt's own (``elastic``), and the
data-parallel gradient buckets (``ddp``)."""
