"""The only layer that knows several strategies exist: it composes them over one mesh and
runs a step (``compose``), and counts what a rank holds (``memory``)."""
