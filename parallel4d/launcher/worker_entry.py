"""``python -m parallel4d.launcher.worker_entry PAYLOAD RANK``: one spawned worker; ``PAYLOAD --fork N``: the
zygote that forks the N workers of a job; ``--template REGISTRY LAUNCHER FD MODULES``: a kept template that
forks each job's zygote (see worker_process.py)."""

import sys

from parallel4d.launcher.worker_process import template_main, worker_main, zygote_main

if __name__ == "__main__":
    if sys.argv[1] == "--template":
        template_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), tuple(filter(None, sys.argv[5].split(","))))
    elif sys.argv[2] == "--fork":
        zygote_main(sys.argv[1], int(sys.argv[3]))
    else:
        worker_main(sys.argv[1], int(sys.argv[2]))
