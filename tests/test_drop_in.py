"""Horovod scripts written as Horovod's documentation shows, run with only the import line changed."""
import re
from pathlib import Path

import pytest

from launcher import run_ranks

# every test here launches ranks
pytestmark = pytest.mark.multiprocess

STYLE = Path(__file__).resolve().parent / "horovod_style"
SWAPS = {"torch_digits.py": ("import horovod.torch as hvd", "import pipesgd_hvd.torch as hvd"),
         "keras_digits.py": ("import horovod.tensorflow.keras as hvd", "import pipesgd_hvd.keras as hvd")}


@pytest.mark.parametrize("script", sorted(SWAPS))
def test_horovod_script_trains_digits_with_only_the_import_line_changed(script, tmp_path):
    original = (STYLE / script).read_text()
    horovod_import, ours = SWAPS[script]
    assert original.count(horovod_import + "\n") == 1
    swapped = original.replace(horovod_import + "\n", ours + "\n")
    changed = [(a, b) for a, b in zip(original.splitlines(), swapped.splitlines()) if a != b]
    assert changed == [(horovod_import, ours)], "exactly one line differs"
    (tmp_path / script).write_text(swapped)
    out = run_ranks(str(tmp_path / script), timeout=400, via_horovodrun=True)  # as users launch it
    results = re.findall(r"RESULT rank=(\d) test_accuracy=([0-9.]+) replicas_equal=(\w+)", out)
    assert sorted(r for r, _, _ in results) == ["0", "1"], out[-3000:]
    for rank, accuracy, equal in results:
        assert equal == "True", f"rank {rank}: replicas differ"
        assert float(accuracy) >= 0.95, f"rank {rank}: test accuracy {accuracy} < 0.95"
