"""benchmarks/results/posttrain-cpu-2026-12-07b/analyze.py: the tables of a sampled evaluation read from its raw
cache (adjacent levels apart, per-difficulty fits, the paired tests on the problems two evaluations share)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks/results/posttrain-cpu-2026-12-07b/analyze.py"


@pytest.fixture(scope="module")
def A():
    spec = importlib.util.spec_from_file_location("analyze_0707b", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def raw(lengths: dict, correct: dict | None = None, fam=None, diff=None) -> dict:
    """A raw cache's results: {b: {correct, length, difficulty, family}}."""
    k = len(next(iter(lengths.values())))
    fam = fam or ["sums", "chase"] * (k // 2)
    diff = diff or [2 + i % 5 for i in range(k)]
    return {b: {"length": list(v), "correct": list((correct or {}).get(b, [0] * k)), "difficulty": list(diff),
                "family": list(fam)} for b, v in lengths.items()}


def test_adjacent_apart_and_not(A):
    # 1 -> 2: a rise of 10 with a spread of 1 (apart); 2 -> 3: a rise of 0.1 with a spread of 10 (up, not apart);
    # 3 -> 4: a fall
    res = raw({1: [0, 2] * 50, 2: [10, 12] * 50, 3: [1.1, 21.1] * 50, 4: [5, 5] * 50})
    adj = A.adjacent(A.levels_table(res))
    assert [a["increasing"] for a in adj] == [True, True, False]
    assert [a["apart"] for a in adj] == [True, False, False]
    assert adj[0]["rise"] == pytest.approx(10.0)


def test_fits_per_difficulty_and_flat(A):
    # difficulty 2: length = 3 + 0.5 b exactly (slope 0.5, R^2 1); difficulty 3: the same length at every level
    lv = (1, 12, 25)
    res = {b: {"length": [3 + 0.5 * b, 7], "correct": [1, 0], "difficulty": [2, 3], "family": ["sums", "sums"]}
           for b in lv}
    f = A.fits(res)
    assert f[2]["slope"] == pytest.approx(0.5) and f[2]["r2"] == pytest.approx(1.0) and not f[2]["flat"]
    assert f[3]["slope"] == pytest.approx(0.0) and f[3]["flat"]
    assert A.fit_text(3, f[3]).endswith("flat")


def test_subset_and_paired_prefix(A):
    # the checkpoint holds 4 problems, the baseline 2: the tests use the shared 2 only
    res = raw({1: [3] * 4, 2: [3] * 4}, {1: [1, 1, 0, 0], 2: [1, 0, 0, 0]})
    base = raw({1: [9] * 2, 2: [9] * 2}, {1: [0, 0], 2: [0, 1]})
    got = A.paired(res, base, 2)
    # pairs: (b1, p0) 0 -> 1, (b1, p1) 0 -> 1, (b2, p0) 0 -> 1, (b2, p1) 1 -> 0
    assert got["all"]["pairs"]["improved"] == 3 and got["all"]["pairs"]["worsened"] == 1
    assert got["all"]["checkpoint"] == pytest.approx(0.75) and got["all"]["baseline"] == pytest.approx(0.25)
    # per problem (summed over the levels): p0 0 -> 2, p1 1 -> 1
    assert got["all"]["per_problem"]["improved"] == 1 and got["all"]["per_problem"]["worsened"] == 0
    # sums only: problem 0 (families alternate sums, chase)
    assert got["sums"]["pairs"]["improved"] == 2 and got["sums"]["pairs"]["worsened"] == 0
    sub = A.subset(res, lambda i, f: i < 2)
    assert all(len(v["length"]) == 2 for v in sub.values())


def test_refuses_other_problems(A, tmp_path, monkeypatch):
    res = raw({1: [3] * 4})
    key = {"problems": ["p0", "p1", "p2", "p3"], "levels": [1], "temperature": 1.0, "constrain": "sml"}
    (tmp_path / "a.json").write_text(json.dumps({"key": key, "res": res}))
    other = dict(key, problems=["p0", "px"])
    (tmp_path / "b.json").write_text(json.dumps({"key": other, "res": raw({1: [3] * 2})}))
    monkeypatch.setattr("sys.argv", ["analyze.py", str(tmp_path / "a.json"), "--base-raw", str(tmp_path / "b.json")])
    with pytest.raises(SystemExit, match="do not share"):
        A.main()
    # the same prefix passes and writes the summary
    (tmp_path / "b.json").write_text(json.dumps({"key": dict(key, problems=["p0", "p1"]), "res": raw({1: [3] * 2})}))
    monkeypatch.setattr("sys.argv", ["analyze.py", str(tmp_path / "a.json"), "--base-raw", str(tmp_path / "b.json"),
                                     "--prefix", "0", "--out", str(tmp_path / "s.json")])
    A.main()
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["paired"]["problems"] == 2 and s["problems"] == 4
