"""Everything before and around the workers: the preflight and ``launch()`` (``launch``), the
run directory (``rundir``), and local workers spawned, supervised and blamed (``workers``)."""
