"""The command line (``cli``) and what only it runs: ``plan``, ``generate`` and ``plot``."""
