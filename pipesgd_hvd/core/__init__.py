"""The framework-free optimizer core: options, the policy of a pipelined optimizer, its checkpoint
format. Framework adapters (``pipesgd_hvd/frameworks/``) translate to it and decide nothing."""
