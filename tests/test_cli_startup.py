"""A CLI error that needs no framework comes back without importing one.

A missing argument, a path that does not exist, a folder of the wrong kind: each is checked
before torch, JAX, TensorFlow or onnxruntime is imported (importing torch alone takes seconds).
The check is on ``sys.modules`` in a fresh interpreter, not on the wall clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "jax", "flax", "tensorflow", "onnxruntime", "transformers")

_RUN = """
import json, sys
FRAMEWORKS = json.loads(sys.argv[2])
from xconv.cli import main
seen = {}
for args in json.loads(sys.argv[1]):
    try:
        main(args, standalone_mode=True)
    except SystemExit as e:
        code = e.code
    seen[" ".join(args)] = [code, [m for m in FRAMEWORKS if m in sys.modules]]
print("RESULT" + json.dumps(seen))
"""


def test_usage_errors_import_no_framework(tmp_path):
    (tmp_path / "plain").mkdir()
    hub = tmp_path / "remote"
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps({"architectures": ["X"], "auto_map": {"A": "m.X"}}))
    calls = [
        ["torch-to-flax"],
        ["torch-to-flax", str(tmp_path / "plain")],
        ["torch-to-flax", str(hub)],
        ["torch-to-jax", str(tmp_path / "nothere.pt")],
        ["onnx-to-jax", str(tmp_path / "plain")],
        ["inspect", str(tmp_path / "nothere.onnx")],
        ["inspect", str(tmp_path / "plain")],
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run([sys.executable, "-c", _RUN, json.dumps(calls), json.dumps(FRAMEWORKS)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, r.stdout + r.stderr
    seen = json.loads(line.removeprefix("RESULT"))
    for args, (code, imported) in seen.items():
        assert code == 2, (args, code, r.stderr)
        assert imported == [], f"xconv {args} imported {imported} before refusing the call"
