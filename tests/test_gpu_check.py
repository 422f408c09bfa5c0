"""tools/gpu_check.py --device cpu: the GPU check's assertions on the CPU, so that the script
cannot rot between GPU runs (it fails this test when any of its checks fails)."""
import subprocess
import sys

import pytest

from launcher import ROOT, rank_env

SCRIPT = ROOT / "tools" / "gpu_check.py"


@pytest.mark.multiprocess
def test_gpu_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_cpu.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)], cwd=ROOT,
                          env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")]
    for section in "bcdegh":  # every section ran checks ((a) reports figures, (f) is CUDA only)
        assert any(line.startswith(f"PASS {section}.") for line in lines), section
    assert "SKIP f.horovod-nccl" in proc.stdout
    text = out.read_text()
    assert "| PASS | c.engine-2ranks.int4.width2 |" in text and "--device cpu" in text


def test_a_failing_check_makes_the_script_exit_non_zero(monkeypatch):
    gpu_check = pytest.importorskip("tools.gpu_check")
    for name in ("section_b", "section_c", "section_d", "section_e", "section_f", "section_g", "section_h"):
        monkeypatch.setattr(gpu_check, name, lambda report, *a, **k: None)
    monkeypatch.setattr(gpu_check, "section_a", lambda report, *a, **k: report.check(False, "a.forced") and 1.0)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu"])
    assert gpu_check.main() == 1


def test_cuda_requested_without_a_gpu_fails_with_the_reason():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], cwd=ROOT, env=rank_env(),
                          capture_output=True, text=True, timeout=120)
    if "torch.cuda.is_available() is False" not in proc.stdout:
        pytest.skip("a GPU is present: gpu_check.py --device cuda is the real run, not a test")
    assert proc.returncode == 1


def test_gpu_install_names_the_cuda_code_the_package_loads():
    """docs/gpu_install.md once said that nothing in the package builds or loads CUDA code; the
    Triton kernels are CUDA code it compiles and loads. Every module that imports triton must be
    named there."""
    text = (ROOT / "docs" / "gpu_install.md").read_text()
    assert "Nothing in the package builds or loads CUDA code" not in text
    loaders = [p for p in (ROOT / "pipesgd_hvd").rglob("*.py") if "\nimport triton" in p.read_text()]
    assert loaders, "no module imports triton: this test looks for the wrong thing"
    for module in loaders:
        assert str(module.relative_to(ROOT)) in text, module
