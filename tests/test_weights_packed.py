"""Weights held as the checkpoint stores them (docs/model.md §9; `dsv41/model/packed_weights.py`): the GEMMs that
read the packed bytes give the dequantized path's bits (official block order and the deterministic mode's exact
blocks), a packed model's logits equal the dense model's bit for bit on the CPU, the held bytes equal
`dsv41.analysis.memory`'s count, and loading / saving converts between the storages without loss. The golden
parity gates run here once more on the packed model (the golden tests' own functions, with a packed fixture).

Bitwise equality is the point and holds by construction: a packed block dequantizes to the very fp32 values the
dense weight holds (code x power-of-two scale, one product), and the GEMM then runs the same ops in the same order.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.analysis.memory import memory_report
from dsv41.codecs.weights import PackedWeight, dequant_fp8, pack_weight
from dsv41.config import load_config
from dsv41.kernels import gemm_ref
from dsv41.kernels.gemm_ref import block_scaled_linear_ref
from dsv41.kernels.invariant import deterministic, exact_block_linear
from dsv41.kernels.moe_ref import moe_experts_ref
from dsv41.model.cache import DenseCache
from dsv41.model.common import Linear
from dsv41.model.init import random_model
from dsv41.model.loading import load_model, official_tensors, representable, save_checkpoint, write_official
from dsv41.model.packed_weights import (engram_tables_on_host, is_packed, pack_weights, resident_weight_bytes,
                                        unpack_weights)
from dsv41.model.shards import ShardReader
from tests.conftest import GOLDEN
from tests.test_golden import (blocks, test_gate1_official_artifact_is_localised,  # noqa: F401  (re-run, packed)
                               test_gate1_teacher_forced_fp32_fix, test_gate2_end_to_end_fp32_fix,
                               test_official_decode_artifact_end_to_end)

CASE_A = GOLDEN / "case-a"


@pytest.fixture(scope="module")
def model_fp32():
    """The golden tests' model, packed: their gate tests above run on it."""
    m = load_model(CASE_A, storage="packed")[0]
    assert is_packed(m)
    return m


def _packed(w: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[PackedWeight, torch.Tensor]:
    codes, scale = pack_weight(w, kind)
    pw = PackedWeight(codes, scale, kind, tuple(w.shape), dtype)
    return pw, pw.dequant()


@pytest.mark.parametrize("kind,N,K", [("fp8", 70, 96), ("fp8", 64, 4096), ("fp4", 40, 160), ("fp4", 33, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemms_read_packed_bytes_bit_for_bit(kind, N, K, dtype, monkeypatch):
    """Both CPU GEMMs of a quantized weight: packed == dense, bit for bit, for 1 and many rows, whole and chunked."""
    g = torch.Generator().manual_seed(N + K)
    pw, dense = _packed(torch.randn(N, K, generator=g) * 0.05, kind, dtype)
    assert dense.dtype == dtype and pw.nbytes < dense.numel() * dense.element_size()
    for rows in (1, 5, 37):
        x = torch.randn(rows, K, generator=g).to(dtype)
        want = block_scaled_linear_ref(x, dense)
        assert torch.equal(block_scaled_linear_ref(x, pw), want)
        monkeypatch.setattr(gemm_ref, "CHUNK_BYTES", 4 * N * 64)           # chunks of 64 columns
        assert torch.equal(block_scaled_linear_ref(x, pw), want)
        monkeypatch.undo()
        assert torch.equal(exact_block_linear(x, pw), exact_block_linear(x, dense))


def test_packed_block_values_are_the_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 200, generator=g)
    codes, scale = pack_weight(w, "fp8")
    pw = PackedWeight(codes, scale, "fp8", (50, 200), torch.float32)
    full = dequant_fp8(codes, scale)
    assert torch.equal(torch.cat([pw.cols(k, min(k + 64, 200)) for k in range(0, 200, 64)], 1), full)
    assert not torch.equal(full, w)                           # the packing rounds unrepresentable values


def test_moe_experts_ref_reads_packed_experts():
    g = torch.Generator().manual_seed(3)
    D, F, E, N = 64, 32, 4, 9
    ws = {n: [torch.randn(*s, generator=g) * 0.1 for _ in range(E + 1)] for n, s in
          (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F)))}
    packed = {n: [_packed(w, "fp4", torch.float32)[0] for w in v] for n, v in ws.items()}
    dense = {n: [p.dequant() for p in v] for n, v in packed.items()}
    x = torch.randn(N, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(N)])
    wts = torch.rand(N, 2, generator=g)
    for det in (False, True):
        with deterministic(det):
            for quant in (True, False):
                a = moe_experts_ref(x, idx, wts, dense["w1"], dense["w3"], dense["w2"], 10.0, quant, quant)
                b = moe_experts_ref(x, idx, wts, packed["w1"], packed["w3"], packed["w2"], 10.0, quant, quant)
                assert torch.equal(a, b), (det, quant)


def _logits(model, cfg, ids, dtype):
    cache = DenseCache(cfg, ids.size(0), dtype)
    with torch.no_grad():
        pre = model(ids[:, :-3], cache).logits
        dec = [model(ids[:, t:t + 1], cache).logits for t in range(ids.size(1) - 3, ids.size(1))]
    return torch.cat([pre, *dec], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_model_logits_equal_the_dense_model_bit_for_bit(dtype):
    """The golden checkpoint loaded both ways: prefill and decode logits identical, in both modes."""
    dense, cfg = load_model(CASE_A, dtype=dtype)
    packed, _ = load_model(CASE_A, dtype=dtype, storage="packed")
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(packed, cfg, ids, dtype), _logits(dense, cfg, ids, dtype))
    with deterministic():
        assert torch.equal(_logits(packed, cfg, ids, dtype), _logits(dense, cfg, ids, dtype))


def test_resident_bytes_equal_the_memory_analysis():
    model, cfg = load_model(CASE_A, dtype=torch.bfloat16, storage="packed")
    rep = memory_report(cfg)
    held = resident_weight_bytes(model)
    assert held["weights"] == rep["weights"]["bytes"]
    assert held["engram_tables"] == rep["engram_tables"]["bytes"]
    dense = resident_weight_bytes(load_model(CASE_A, dtype=torch.bfloat16)[0])
    assert sum(dense.values()) == rep["today"]["bytes"]


def test_pack_unpack_and_formats_round_trip(tmp_path):
    """pack_weights of a representable model changes no value; the official writer writes the same bytes from
    either storage; our own format saved packed or dense loads into either storage."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=5)
    representable(m, cfg)
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    dense_files = official_tensors(m, cfg)
    pack_weights(m)
    lin = m.layers[2].attn.wq_a
    assert isinstance(lin, Linear) and lin.packed and lin.weight.dtype == torch.uint8
    assert m.layers[1].engram.packed
    packed_files = official_tensors(m, cfg)
    assert dense_files.keys() == packed_files.keys()
    for k in dense_files:
        assert torch.equal(dense_files[k].view(torch.uint8) if dense_files[k].element_size() == 1 else dense_files[k],
                           packed_files[k].view(torch.uint8) if packed_files[k].element_size() == 1
                           else packed_files[k]), k
    save_checkpoint(m, cfg, tmp_path / "packed")
    write_official(m, cfg, tmp_path / "official", shards=3)
    for src in ("packed", "official"):
        for storage in ("dense", "packed"):
            m2 = load_model(tmp_path / src, storage=storage)[0]
            assert is_packed(m2) == (storage == "packed")
            unpack_weights(m2)
            assert all(torch.equal(v, ref[k]) for k, v in m2.state_dict().items())
    unpack_weights(m)
    assert not is_packed(m) and all(torch.equal(v, ref[k]) for k, v in m.state_dict().items())


def test_packing_a_trained_model_rounds_like_the_official_writer(tmp_path):
    """`dsv41 train` output (dense master weights) packed for serving = written officially, then loaded."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=6)
    save_checkpoint(m, cfg, tmp_path / "own")
    write_official(m, cfg, tmp_path / "official")
    a = load_model(tmp_path / "own", storage="packed")[0].state_dict()
    b = load_model(tmp_path / "official", storage="packed")[0].state_dict()
    assert a.keys() == b.keys()
    packed = [k for k in a if a[k].dtype == torch.uint8]                  # the writer also rounds bf16 kinds
    assert len(packed) > 100 and all(torch.equal(a[k], b[k]) for k in packed)


def test_packed_linear_trains_through_its_dequantized_weight():
    """Autograd (and CUDA) take the dequantized weight: the same output as the dense Linear."""
    lin = Linear(64, 48, "fp8", torch.float32)
    torch.nn.init.normal_(lin.weight, std=0.1)
    x = torch.randn(3, 64, requires_grad=True)
    lin.pack()
    dense = Linear(64, 48, "fp8", torch.float32)
    with torch.no_grad():
        dense.weight.copy_(lin.dense_weight())
    lin.train()
    dense.train()
    assert torch.equal(lin(x), dense(x))
    lin(x).sum().backward()
    assert x.grad is not None


def test_shard_reader_views_and_errors(tmp_path):
    cfg = load_config("debug")
    write_official(random_model(cfg, seed=1), cfg, tmp_path / "ck", shards=2)
    with ShardReader(tmp_path / "ck") as r:
        name = "layers.2.attn.wq_a.weight"
        assert r.info(name) == (torch.float8_e4m3fn, (cfg.q_lora_rank, cfg.dim))
        with r.tensor(name) as t:
            first = t.view(torch.uint8).clone()
        with r.tensor(name) as t:
            assert torch.equal(t.view(torch.uint8), first)            # pages dropped and read again
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.safetensors").write_bytes(b"\x05")
    with pytest.raises(ValueError, match="not a safetensors file"):
        ShardReader(tmp_path / "bad")


def test_engram_tables_stay_in_host_memory():
    """Host tables: the same lookups on the CPU (no copy), and they stay behind when the model moves."""
    cfg = load_config("debug")
    m = pack_weights(random_model(cfg, seed=1))
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m(ids, DenseCache(cfg, 2, torch.float32)).logits
        engram_tables_on_host(m)
        assert torch.equal(m(ids, DenseCache(cfg, 2, torch.float32)).logits, before)
    m.to("meta")
    assert m.layers[1].engram.embed.weight.device.type == "cpu"
    assert m.layers[1].engram.wkv.weight.device.type == "meta"
    with pytest.raises(ValueError, match="packed storage"):
        engram_tables_on_host(random_model(cfg, seed=1))


def test_engram_table_packs_in_row_chunks(monkeypatch):
    """A table packed a few rows at a time holds the same bytes as one packed whole (rows are independent), also
    where the chunk does not divide the rows."""
    from dsv41.model import engram
    t = torch.randn(37, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 37)[:, None]
    codes, scale = pack_weight(t, "fp8_rows")
    monkeypatch.setattr(engram, "PACK_CHUNK", 5 * 64)
    chunked = engram.PackedTable.of(t)
    assert torch.equal(chunked.weight, codes) and torch.equal(chunked.scale, scale)


def _host_engram_model(seed: int = 1):
    cfg = load_config("debug")
    return cfg, engram_tables_on_host(pack_weights(random_model(cfg, seed=seed)))


def test_engram_rows_are_fetched_before_the_layer_runs():
    """`prefetch_host_rows` gathers a step's rows when the ids are hashed: the lookup uses them (changing the table
    afterwards does not reach it), and a lookup of other ids is never served the prefetched rows."""
    from dsv41.model.engram import prefetch_host_rows
    cfg, m = _host_engram_model()
    engrams = [b.engram for b in m.layers if b.engram is not None]
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    hashes = m.engram_hashes(ids, DenseCache(cfg, 2, torch.float32), None)        # prefetches
    e = engrams[0]
    want = e.embed(hashes[:, :, e.layer_index]).clone()                            # consumed: gathered now
    prefetch_host_rows(engrams, hashes)
    saved = e.embed.weight.clone()
    e.embed.weight.zero_()
    assert torch.equal(e.embed(hashes[:, :, e.layer_index]), want)                 # the rows fetched ahead
    other = hashes[:, :, e.layer_index].flip(1).contiguous()
    prefetch_host_rows(engrams, hashes)
    assert not e.embed(other).any()                                                # gathered now: zeros
    e.embed.weight.copy_(saved)


def test_engram_table_placement_switch(tmp_path):
    """load_model's engram_tables: host keeps the packed tables behind on a move; auto keeps small ones on the
    device; the logits do not depend on it."""
    cfg = load_config("debug")
    m = random_model(cfg, seed=2)
    save_checkpoint(m, cfg, tmp_path / "ck")
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for choice in ("host", "device", "auto"):
        mm, _ = load_model(tmp_path / "ck", storage="packed", engram_tables=choice)
        assert mm.layers[1].engram.embed.host == (choice == "host")
        with torch.no_grad():
            out[choice] = mm(ids, DenseCache(cfg, 1, torch.float32)).logits
    assert torch.equal(out["host"], out["device"]) and torch.equal(out["auto"], out["device"])
    with pytest.raises(ValueError, match="engram_tables"):
        load_model(tmp_path / "ck", storage="packed", engram_tables="disk")


@pytest.mark.gpu
def test_engram_host_tables_on_gpu_equal_device_tables():
    """On a GPU, host tables (rows prefetched on the side stream) give the device tables' logits bit for bit over
    prefill and decode steps."""
    cfg = load_config("debug")
    dev = pack_weights(random_model(cfg, seed=1)).cuda()
    host = engram_tables_on_host(pack_weights(random_model(cfg, seed=1))).cuda()
    assert host.layers[1].engram.embed.weight.device.type == "cpu"
    assert host.layers[1].engram.embed.weight.is_pinned()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    caches = [DenseCache(cfg, 2, torch.float32, device="cuda") for _ in range(2)]
    with torch.no_grad():
        for t in [ids[:, :12], *ids[:, 12:].split(1, dim=1)]:
            a, b = (mm(t, c).logits for mm, c in zip((dev, host), caches))
            assert torch.equal(a, b)
