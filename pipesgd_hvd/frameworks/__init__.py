"""Framework adapters and their tensor-operation tables. Nothing here is imported eagerly:
``pipesgd_hvd.torch`` must not pull in TensorFlow, nor ``pipesgd_hvd.keras`` PyTorch."""
