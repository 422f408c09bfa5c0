"""The optimizer, framework-free: the per-step policy of a pipelined optimizer (``core.py``), the
pipeline's life around the steps (``lifecycle.py``: name, auto switch, elastic, checkpoint), the
arguments (``options.py``, checked once), the checkpoint format (``checkpoint.py``), the rule under
Horovod elastic (``elastic.py``), and what a framework implements for it (``adapter.py``).
The framework packages (``pipesgd_hvd.torch``, ``pipesgd_hvd.tensorflow``) translate to it and
decide nothing."""
