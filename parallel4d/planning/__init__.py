"""Choosing a layout: the time model and its device profiles, and the search over layouts.

``trace`` (every op of a dry-run step) → ``profiles`` (what a device charges per op and per byte; data
under ``devices/``, or ``calibrate``'d on this machine) → ``cost`` (a job's predicted step) →
``search`` (every layout of N devices that fits, ranked). The dry run itself is
:mod:`parallel4d.planning.dry_run`'s.
"""
