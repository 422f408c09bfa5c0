"""Runs several scripts of tests/mp one after the other in one launch, each as if launched alone
(``runpy``, as ``__main__``; Horovod is initialized once, which a script's own ``hvd.init()``
leaves as it is).

Why: a rank spends some 5 s of a core importing TensorFlow, and the two ranks of a launch share
the machine's two cores with the other test worker; the Keras tests of one file launch once.
Stops at the first script that fails (the other ranks could not keep their collectives in step
past it). Prints ``DONE <script>`` after each.

Usage: in_one_launch.py SCRIPT [SCRIPT ...]   (names relative to tests/mp, no arguments of their own)
"""
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in sys.argv[1:]:
    path = str(HERE / script)
    sys.argv = [path]
    runpy.run_path(path, run_name="__main__")
    print(f"DONE {script}", flush=True)
