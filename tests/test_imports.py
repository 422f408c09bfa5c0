"""Each entry module loads only its own framework (a PyTorch user does not pay for TensorFlow)."""
import pytest

from benchmarks.import_time import measure


@pytest.mark.parametrize("module,loads,not_loaded", [
    ("pipesgd_hvd.torch", "torch", "tensorflow"),
    ("pipesgd_hvd.keras", "tensorflow", "torch"),
    ("pipesgd_hvd.tensorflow", "tensorflow", "torch"),
])
def test_entry_module_loads_only_its_framework(module, loads, not_loaded):
    result = measure(module)
    assert result[loads] is True
    assert result[not_loaded] is False, f"import {module} loaded {not_loaded}"


@pytest.mark.parametrize("module", ["pipesgd_hvd.optimizer.core", "pipesgd_hvd.optimizer.lifecycle", "pipesgd_hvd.pipeline.engine",
                                    "pipesgd_hvd.pipeline.schedule", "pipesgd_hvd.ops.numpy"])
def test_framework_free_layers_load_no_framework(module):
    result = measure(module)
    assert result["torch"] is False and result["tensorflow"] is False, f"import {module} loaded a framework"
