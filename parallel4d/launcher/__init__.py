"""Everything before and around the workers: the preflight and ``launch()`` (``launch``), the
run directory (``rundir``), and a local job's workers: ``spawn`` (the entry), ``workers`` (the launcher's
handles on the processes, the zygote), ``worker_process`` (what runs inside them), ``supervise`` (until they
end; stop signals) and ``blame`` (which failure caused the others)."""
