"""Tools beside the package: the emulated cluster (``tools/cluster``) and the GPU check."""
