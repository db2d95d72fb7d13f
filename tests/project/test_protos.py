"""The generated code in gpipe/service/v1 is what protos/ generates now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], cwd=ROOT, check=True)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*.py*")}
    assert fresh, "protoc generated nothing"
    for rel, text in fresh.items():
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed: run make protos"
        assert committed.read_text() == text, f"{rel} is stale: run make protos"
