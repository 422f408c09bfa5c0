"""pipesgd_hvd: pipelined (Pipe-SGD) data-parallel training for Horovod.

Import the entry module of your framework: ``pipesgd_hvd.torch``, ``pipesgd_hvd.keras`` or
``pipesgd_hvd.tensorflow``. This package itself imports no framework.
"""
__version__ = "0.1.0"
