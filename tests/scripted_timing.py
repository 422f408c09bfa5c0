"""A fake clock and a scripted probe for the auto mode's tests (in-process and under horovodrun).

The optimizer's auto controller reads compute time from its clock and reduction times from its
probe; the tests replace both so every rank sees exactly the numbers the test chose.
"""
from pipesgd_hvd.auto.controller import model_name
from pipesgd_hvd.auto.model import CODECS


class FakeClock:
    """Time stands still until the test advances ``now`` (by a rank's "compute" per step)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class ScriptedProbe:
    """The float32 all-reduce takes the next scripted value (one per check); a codec's reduction
    what the timing model predicts from it (the wire ratio, plus half its scripted encode + decode
    cost: (N-1)/N of it rides with the reduction on 2 ranks); no CPU unless scripted. ``timed``
    lists which codecs each check timed."""

    def __init__(self, allreduce_s, codec_s=None, cpu_s=None):
        self.allreduce = list(allreduce_s)
        self.codec = codec_s or {}
        self.cpu = cpu_s or {}
        self.checks = 0
        self.timed = []
        self.seconds = 0.0

    def reduction(self, comm, ops, codec, flat):
        name = model_name(codec)
        if name == "none":  # every check times the float32 all-reduce first
            self.seconds = self.allreduce[min(self.checks, len(self.allreduce) - 1)]
            self.checks += 1
            self.timed.append([])
        self.timed[-1].append(name)
        return self.seconds * CODECS[name].ratio + self.codec.get(name, 0.0) / 2, self.cpu.get(name, 0.0)
