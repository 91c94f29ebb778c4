"""bench/vlm_throughput.py --smoke runs on CPU and writes its JSON with the vision share."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_vlm_throughput_smoke(tmp_path):
    out = tmp_path / "vlm.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "vlm_throughput.py"), "--smoke",
                           "--stage", "all", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vision" in proc.stdout and "tokens/s" in proc.stdout
    data = json.loads(out.read_text())
    (result,) = data["results"]
    assert result["tokens_per_s"] > 0 and result["losses_finite"]
    assert 0 < result["vision_share"] < 5  # measured alone: a share, not a bound
    assert result["trainable_parameters"] == result["parameters"]  # stage all
    assert result["image_tokens"] == 16
