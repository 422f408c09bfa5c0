"""``hvd.elastic``: Horovod elastic for Keras 3, with the pipelined optimizer or without it (the
implementation and the rule: frameworks/tf_elastic.py, pipesgd_hvd/elastic.py)."""
from ..frameworks.tf_elastic import (  # noqa: F401
    CommitStateCallback, KerasState, TensorFlowKerasState, UpdateBatchStateCallback, UpdateEpochStateCallback, run)

__all__ = ["CommitStateCallback", "KerasState", "TensorFlowKerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
