"""Guards benchmarks/decode_census.py (run as a script: it rewires the model's kernel ops): one decode step of the
40-layer v41-geometry structure calls the per-layer kernel ops once per layer, and the MoE takes the experts op."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_decode_census_counts_one_step():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_census.py"), "--context", "600",
                          "--top", "5"], capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    rec = json.loads(out.strip().splitlines()[-1])
    calls, layers = rec["kernel_op_calls"], rec["layers"]
    assert layers == 40
    assert calls["sparse_attn_packed"] == layers and calls["pack_swa_rows"] == layers
    assert calls["moe_experts"] == layers                    # every MoE layer took the experts op, none the loop
    assert 0 < rec["non_view_ops"] and len(rec["top_lines"]) == 5
