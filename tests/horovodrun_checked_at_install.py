"""``horovodrun``, without the build check it repeats at every launch.

Before each Gloo launch horovodrun forks a process that imports Horovod's first framework
extension (TensorFlow's) to ask whether Horovod was built with Gloo: 1.5 s of a core per launch
here, some 30 launches in the suite (its MPI launches run mpirun itself: tests/launcher.py).
``scripts/install.sh`` asks the same once (``horovodrun --check-build`` must list Gloo and MPI),
so the suite's Gloo launches skip it; everything else (rendezvous, the ranks' environment, output
prefixes, ending the other ranks when one fails, elastic discovery) is horovodrun's own code.
Usage: the arguments of ``horovodrun``.
"""
import sys

import horovod.runner.launch as launch

launch.gloo_built = lambda verbose=False: True

if __name__ == "__main__":
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())
