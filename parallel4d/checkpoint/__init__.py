"""Checkpoints: layout-free DCP save and load (``dcp``) over each rank's pieces of the dense
tensors (``shards``); the checkpoint directory's names (``steps``), checksums (``checksums``), the
checkpoint to resume from and the refusals before a start (``resume``), a failure's diagnosis and
the ranks' agreement on it (``failures``), durable small writes (``files``), the rules of every
command's output (``outputs``); the single-file and Hugging Face exports (``gather``, ``export``)."""
