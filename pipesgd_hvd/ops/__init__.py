"""The tensor-op tables the shared code computes with: the protocol (``base.py``), the seeds of
stochastic rounding (``seeds.py``), and one table per framework: numpy (the reference of the
tests), PyTorch (with its CUDA stream rules, ``torch_cuda.py``) and TensorFlow."""
