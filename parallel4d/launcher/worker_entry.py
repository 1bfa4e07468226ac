"""``python -m parallel4d.worker_entry PAYLOAD RANK``: one spawned worker; ``PAYLOAD --fork N``: the
zygote that forks the N workers of a job (see workers.py)."""

import sys

from parallel4d.launcher.workers import _worker_main, _zygote_main

if __name__ == "__main__":
    if sys.argv[2] == "--fork":
        _zygote_main(sys.argv[1], int(sys.argv[3]))
    else:
        _worker_main(sys.argv[1], int(sys.argv[2]))
