"""The parallel plan on one GPU (NCCL, world size 1): a rank loaded by `load_sharded` on the GPU computes what the
one-device model loaded by `load_model` computes there, bit for bit, for dense and packed storage, and generates the
same greedy tokens through the Engine. At one rank the plan's collectives are identities (`Group` of one rank), so
this checks the per-rank loading and the rank model's layers on the device, not NCCL's reductions (that is the
multi-GPU run's issue)."""

from __future__ import annotations

import pytest
import torch

from test_parallel import PROMPTS, free_port


@pytest.mark.gpu
@torch.no_grad()
def test_tp1_on_the_gpu_equals_one_device(tmp_path):
    import torch.distributed as tdist

    from dsv41.config import load_config
    from dsv41.engine.engine import Engine
    from dsv41.engine.sampling import SamplingParams
    from dsv41.model.cache import DenseCache
    from dsv41.model.init import random_model
    from dsv41.model.loading import load_model, write_official
    from dsv41.model.step import ForwardOptions
    from dsv41.parallel.group import Group
    from dsv41.parallel.loading import load_sharded

    cfg = load_config("debug")
    path = write_official(random_model(cfg, seed=1), cfg, tmp_path / "ckpt")
    dev = torch.device("cuda")
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = Group.current()
        assert (group.rank, group.world) == (0, 1)
        ids = torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3)).to(dev)
        for storage in ("dense", "packed"):
            ref, _ = load_model(path, storage=storage, dtype=torch.bfloat16, device=dev)
            par, _ = load_sharded(path, group, storage=storage, dtype=torch.bfloat16, device=dev)
            recs, logits = [{}, {}], []
            for m, rec in zip((ref, par), recs):
                logits.append(m(ids, DenseCache(cfg, 2, torch.bfloat16, device=dev),
                                opts=ForwardOptions(record=rec)).logits)
            blocks = [k for k in recs[0] if isinstance(k, tuple) and k[0] == "block_out"]
            assert blocks
            for k in blocks:
                assert torch.equal(recs[0][k], recs[1][k]), (storage, k)
            assert torch.equal(logits[0], logits[1]), storage
            outs = []
            for m in (ref, par):
                eng = Engine(m, prefill_mode="full", max_batch=2, deterministic=True)
                outs.append([c.output_ids for c in eng.generate(PROMPTS, SamplingParams(max_tokens=12,
                                                                                        ignore_eos=True))])
            assert outs[0] == outs[1], storage
            assert all(len(o) == 12 for o in outs[0])
    finally:
        tdist.destroy_process_group()
