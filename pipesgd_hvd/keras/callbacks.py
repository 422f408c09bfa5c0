"""``hvd.callbacks``: Horovod's Keras callbacks for Keras 3 (see frameworks/keras_callbacks.py)."""
from ..frameworks.keras_callbacks import (  # noqa: F401
    BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback, LearningRateWarmupCallback,
    MetricAverageCallback, PipelineFlushCallback)

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "PipelineFlushCallback"]
