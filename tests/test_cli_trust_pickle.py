"""``xconv torch-to-onnx model.pt --trust-pickle`` run from the folder defining the class."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import onnxruntime as ort

_MODULE = textwrap.dedent(
    """
    import torch

    class TinyNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.bn = torch.nn.BatchNorm1d(3)

        def forward(self, x):
            return self.bn(self.fc(x))
    """
)

# A console script's sys.path holds its bin folder, not the working folder: drop '' (which
# ``python -c`` adds) so the test sees what a user typing ``xconv`` sees.
_XCONV = "import sys; sys.path.remove(''); from xconv.cli import main; main()"


def test_trust_pickle_finds_the_class_in_the_working_folder(tmp_path):
    (tmp_path / "mymodel.py").write_text(_MODULE)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    make = (
        "import sys, torch; sys.path.insert(0, '.'); from mymodel import TinyNet; "
        "torch.save(TinyNet().eval(), 'model.pt')"
    )
    subprocess.run([sys.executable, "-c", make], cwd=tmp_path, env=env, check=True)
    argv = ["torch-to-onnx", "model.pt", "--trust-pickle", "--input-shape", "2,4", "-o", "out"]
    proc = subprocess.run(
        [sys.executable, "-c", _XCONV, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "No module named" not in proc.stdout + proc.stderr
    opts = ort.SessionOptions()
    opts.log_severity_level = 2
    sess = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), opts)
    assert [i.name for i in sess.get_inputs()]
