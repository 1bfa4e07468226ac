"""Checkpoints: layout-free DCP save and load (``dcp``) over each rank's pieces of the dense
tensors (``shards``), and the single-file and Hugging Face exports (``gather``, ``export``)."""
