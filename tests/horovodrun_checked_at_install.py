"""``horovodrun``, without the build check it repeats at every launch.

Before each launch horovodrun forks a process that imports Horovod's first framework extension
(TensorFlow's) to ask whether Horovod was built with the controller asked for: 1.5 s of a core per
launch here, some 30 Gloo launches in the suite. ``scripts/install.sh`` asks the same once
(``horovodrun --check-build`` must list Gloo and MPI), so the suite's launches skip it; everything
else (rendezvous, the ranks' environment, output prefixes, ending the other ranks when one fails,
elastic discovery) is horovodrun's own code. Usage: the arguments of ``horovodrun``.
"""
import sys

import horovod.runner.launch as launch

launch.gloo_built = launch.mpi_built = lambda verbose=False: True

if __name__ == "__main__":
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())
