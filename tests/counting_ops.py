"""A numpy ops table that counts what a compressed all-reduce copies into a padded bucket."""
from pipesgd_hvd.ops.numpy import NumpyOps


class CountingOps(NumpyOps):
    """The numpy table, counting the values ``concat`` copies (the all-reduce's padding copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.concatenated = 0

    def concat(self, xs, axis=0):
        self.concatenated += sum(x.size for x in xs)
        return super().concat(xs, axis)
