"""Each entry module loads only its own framework (a PyTorch user does not pay for TensorFlow)."""
import json
import subprocess
import sys
from typing import Dict

import pytest

PROBE = ("import json, sys; import {module}; "
         "print(json.dumps({{'torch': 'torch' in sys.modules, 'tensorflow': 'tensorflow' in sys.modules}}))")


def measure(module: str) -> Dict[str, bool]:
    """The frameworks a fresh interpreter has loaded after importing ``module``."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                         check=True, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


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
