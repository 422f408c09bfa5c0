import os

# The in-process tests run N ranks as threads in one process; keep each torch op single-threaded
# so the ranks do not fight over the two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
