"""``python -m parallel4d.worker_entry PAYLOAD RANK``: one spawned worker (see workers.py)."""

import sys

from parallel4d.workers import _worker_main

if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]))
