"""A module whose import takes 3 s: a worker start-up longer than a job's time limit (tests/test_faults.py)."""

import time

time.sleep(3.0)
