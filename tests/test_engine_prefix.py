"""Guards prefix caching through the engine (docs/system.md §4): a repeated prompt resumes exactly from the SWA pool
(swa-hit, output identical to the cold run), without the pool it replays the last n_win cached tokens
(replay, deviation measured), a new process with the same cache directory hits, and a dense (unquantized)
model refuses a packed cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dsv41.config import load_config
from dsv41.engine.engine import Engine
from dsv41.engine.sampling import SamplingParams
from dsv41.model.common import set_quantization
from dsv41.model.init import random_model
from dsv41.model.loading import save_checkpoint

PROMPT = [0] + [3 + (7 * i) % 250 for i in range(45)]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("debug"), seed=4)


def first_logprobs(c):
    return torch.tensor([lp for _, lp in c.logprobs[0]["top"]])


def test_swa_hit_is_identical_and_replay_is_measured(model, tmp_path):
    eng = Engine(model, prefill_mode="ced-bounded", cache_dir=tmp_path, swa_pool="memory", cache_interval=16)
    cold = eng.generate([PROMPT], PARAMS)[0]
    assert cold.stats["cache_path"] == "cold" and cold.stats["cached_tokens"] == 0
    warm = eng.generate([PROMPT], PARAMS)[0]
    assert warm.stats["cache_path"] == "swa-hit"
    assert warm.stats["cached_tokens"] == len(PROMPT) - 1
    assert warm.stats["cached_tokens_by_tier"]["swa"] == len(PROMPT) - 1
    assert warm.output_ids == cold.output_ids
    assert torch.equal(first_logprobs(warm), first_logprobs(cold))
    # the SWA pool lives in the process: a new engine on the same directory takes the persistent tier and replays
    eng2 = Engine(model, prefill_mode="ced-bounded", cache_dir=tmp_path, cache_interval=16)
    rep = eng2.generate([PROMPT], PARAMS)[0]
    assert rep.stats["cache_path"] == "replay" and rep.stats["cached_tokens"] == len(PROMPT) - 1
    dev = (first_logprobs(rep) - first_logprobs(cold)).abs().max().item()
    print(f"replay vs cold: max |delta logprob| of the first token's top-5 = {dev:.4f}; "
          f"tokens equal {sum(a == b for a, b in zip(rep.output_ids, cold.output_ids))}/{len(cold.output_ids)}")
    assert len(rep.output_ids) == len(cold.output_ids)


def test_multi_turn_continuation_hits_end_of_output(model, tmp_path):
    eng = Engine(model, prefill_mode="ced-bounded", cache_dir=tmp_path, swa_pool="memory", cache_interval=16)
    a = eng.generate([PROMPT], PARAMS)[0]
    turn2 = PROMPT + a.output_ids + [3 + i for i in range(12)]
    b = eng.generate([turn2], PARAMS)[0]
    assert b.stats["cache_path"] == "swa-hit"
    assert b.stats["cached_tokens"] == len(PROMPT) + len(a.output_ids) - 1      # the end-of-output unit


def test_restart_new_process_hits(model, tmp_path):
    ck = tmp_path / "ck"
    save_checkpoint(model, model.cfg, ck)
    cache = tmp_path / "cache"
    code = (
        "import json,sys; from dsv41.model.loading import load_model; from dsv41.engine.engine import Engine;"
        "from dsv41.engine.sampling import SamplingParams as S;"
        f"m,c=load_model({str(ck)!r}); e=Engine(m, cache_dir={str(cache)!r}, cache_interval=16);"
        f"r=e.generate([{PROMPT!r}], S(max_tokens=3, ignore_eos=True))[0];"
        "print(json.dumps([r.stats['cache_path'], r.output_ids]))")
    outs = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert outs[0][0] == "cold" and outs[1][0] == "replay"


def test_dense_model_refuses_prefix_cache(tmp_path):
    m = random_model(load_config("debug"), seed=1)
    set_quantization(m, False)
    with pytest.raises(ValueError, match="quantized"):
        Engine(m, cache_dir=tmp_path)
