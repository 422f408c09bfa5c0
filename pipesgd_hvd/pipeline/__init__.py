"""The Pipe-SGD mechanism: the width-K engine (``engine.py``), the rule's arithmetic shared with
TensorFlow's traced step (``schedule.py``), fusion buckets (``fusion.py``), the settings every rank
agrees on (``config.py``) and the cross-rank guards (``guards.py``)."""
