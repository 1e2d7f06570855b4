"""Vision path: preprocessing, ViT + 2D RoPE, aligner and span merge against golden case V (tests/data/golden/vision,
a copy of the official-code outputs described in its README). Gate V: per-row relative L2 <= 1e-5 in float32
(measured self-noise 1e-6), <= 3e-2 in bfloat16; pixels, ids, token types, spans and grids exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from dsv41.config import load_config
from dsv41.model import image as im
from dsv41.model import vision as vi

DATA = Path(__file__).parent / "data" / "golden" / "vision"
CKPT = DATA / "case-v"
IMAGES = [DATA / "image0.png", DATA / "image1.png"]
THR_FP32 = 1e-5
THR_BF16 = 3e-2


def rows_rel(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    a, b = ref.double().reshape(-1, ref.shape[-1]), ours.double().reshape(-1, ours.shape[-1])
    return (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)


@pytest.fixture(scope="module")
def cfg():
    return load_config(CKPT)


@pytest.fixture(scope="module")
def gold():
    return load_file(str(DATA / "v.fp32.fix.safetensors"))


@pytest.fixture(scope="module")
def gold_blocks():
    return load_file(str(DATA / "v.fp32.fix.blocks-seq0.safetensors"))


@pytest.fixture(scope="module")
def batch(cfg):
    return im.expand_batch(json.loads((DATA / "input.json").read_text()), IMAGES, cfg)


@pytest.fixture(scope="module")
def tower32(cfg):
    t = vi.VisionTower(cfg, torch.float32)
    vi.load_vision_weights(t, CKPT)
    return t.eval()


# ------------------------------------------------------------------------------------------------ preprocessing

def test_size_plan_documented_numbers(cfg):
    # docs/vision-golden.md §3: image0 shrinks through solve_resize_ratio, image1 takes the upscale path
    assert im.solve_resize_ratio(277, 538, 14, 3, 72) == (210, 406)
    assert im.plan_image_grid(538, 277, cfg) == (5, 10, 210, 406)
    assert im.plan_image_grid(165, 213, cfg) == (7, 6, 280, 224)
    assert im.num_image_tokens(5, 10) == 57 and im.num_image_tokens(7, 6) == 51
    t = im.image_token_types(2, 3)
    assert t.tolist() == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]


def test_pixels_exact(cfg, gold, batch):
    _, _, _, prepared = batch
    for i, prep in enumerate(prepared):
        ref = gold[f"pixel_values.{i}"]
        assert prep.patches.dtype == torch.bfloat16
        assert prep.patches.shape == ref.shape
        assert torch.equal(prep.patches, ref), f"pixel_values.{i} differ"
        assert [prep.n_vit_h, prep.n_vit_w, prep.n_llm_h, prep.n_llm_w] == gold["image_grid"][i].tolist()


def test_expand_prompt_exact(cfg, gold, gold_blocks, batch):
    ids, types, records, _ = batch
    assert torch.equal(ids, gold["input_ids"])
    assert torch.equal(types, gold["token_types"])
    assert torch.equal(im.image_spans(records), gold["image_spans"])
    # the same image in two rows shares one processed patch tensor
    assert records[0][1].patches is records[1][0].patches
    ids0, types0, rec0, _ = im.expand_batch(json.loads((DATA / "input-seq0.json").read_text()), IMAGES, cfg)
    assert torch.equal(ids0, gold_blocks["input_ids"])
    assert torch.equal(types0, gold_blocks["token_types"])
    assert [r.start for r in rec0[0]] == [1, 68]
    # one sequence through expand_prompt directly; sources as bytes and PIL images give the same result
    seq = json.loads((DATA / "input.json").read_text())[1]
    srcs = [IMAGES[0].read_bytes(), Image.open(IMAGES[1])]
    i1, t1, r1 = im.expand_prompt(seq, srcs, cfg)
    assert torch.equal(i1, gold["input_ids"][1]) and torch.equal(t1, gold["token_types"][1])
    assert torch.equal(r1[0].patches, gold["pixel_values.1"])


def test_plan_never_exceeds_budget(cfg):
    sizes = [(1, 1), (1, 4000), (4000, 1), (14, 14), (300, 7), (7, 300), (2000, 30), (30, 2000), (246, 246),
             (538, 277), (5000, 3000), (43, 9001)]
    sizes += [(w, h) for w in (10, 97, 251, 640, 1333) for h in (13, 89, 250, 777, 2048)]
    p, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
    for w, h in sizes:
        n_h, n_w, bh, bw = im.plan_image_grid(w, h, cfg)
        assert bh % p == 0 and bw % p == 0 and bh > 0 and bw > 0, (w, h)
        assert (n_h, n_w) == (math.ceil(bh // p / r), math.ceil(bw // p / r))
        assert im.num_image_tokens(n_h, n_w) <= cfg.vision_max_n_token, (w, h)


def test_extreme_and_wh_ratio_images(cfg):
    wide = Image.new("RGB", (900, 30), (10, 200, 30))
    prep = im.preprocess_image(wide, cfg)
    assert prep.patches.shape == (prep.n_vit_h * prep.n_vit_w, 3, 14, 14)
    assert prep.span_len <= cfg.vision_max_n_token
    # vision_max_wh_ratio set: over-wide images are clamped in the plan and stretched instead of letterboxed
    c2 = cfg.replace(vision_max_wh_ratio=2)
    prep2 = im.preprocess_image(wide, c2)
    assert prep2.patches.shape[0] == prep2.n_vit_h * prep2.n_vit_w
    px = prep2.patches.float()
    assert torch.allclose(px[:, 0], torch.full_like(px[:, 0], 10 / 255 * 2 - 1), atol=1e-2)  # no gray border


def test_bad_inputs(cfg, tmp_path):
    txt = tmp_path / "not_an_image.png"
    txt.write_text("hello, I am not a PNG\n")
    with pytest.raises(ValueError):
        im.preprocess_image(txt, cfg)
    with pytest.raises(ValueError):
        im.preprocess_image(b"", cfg)
    with pytest.raises(ValueError):
        im.preprocess_image(IMAGES[0].read_bytes()[:60], cfg)  # truncated PNG
    with pytest.raises(ValueError):
        im.preprocess_image(Image.new("RGB", (0, 5)), cfg)
    with pytest.raises(ValueError):
        im.preprocess_image(Image.new("RGB", (7, 0)), cfg)
    with pytest.raises(ValueError):
        im.plan_image_grid(0, 10, cfg)
    with pytest.raises(ValueError):
        im.expand_prompt([0, {"image": 0}], [txt], cfg)
    # malformed prompts
    for bad in ([0, cfg.image_token_id], [0, {"image": 2}], [0, {"img": 0}], [0, {"image": 0, "x": 1}],
                [0, cfg.vocab_size], [0, -1], [0, "7"], [0, {"image": True}]):
        with pytest.raises(ValueError):
            im.expand_prompt(bad, IMAGES, cfg)
    with pytest.raises(ValueError):
        im.expand_batch([[0, 1, 2], [0, {"image": 1}]], IMAGES, cfg)  # different expanded lengths
    with pytest.raises(ValueError):
        im.expand_prompt([0, {"image": 0}], IMAGES, cfg.replace(vision_n_layers=0))


# ------------------------------------------------------------------------------------------------ ViT + aligner

def test_parameter_names_match_checkpoint(cfg):
    idx = json.loads((CKPT / "model.safetensors.index.json").read_text())["weight_map"]
    ckpt_vision = {n for n in idx if vi.is_vision_tensor(n)}
    t = vi.VisionTower(cfg, torch.bfloat16)
    params = dict(t.named_parameters())
    assert set(params) == ckpt_vision
    for n, p in params.items():
        assert p.dtype == (torch.float32 if n.endswith(("norm1.weight", "norm2.weight", "vision.norm.weight"))
                           else torch.bfloat16), n


def test_vit_aligner_fp32_golden(cfg, gold, gold_blocks, tower32):
    with torch.no_grad():
        for i in range(2):
            n_vit_h, n_vit_w = gold["image_grid"][i, :2].tolist()
            px = gold[f"pixel_values.{i}"]  # the golden pixels: checks the tower independent of preprocessing
            hid = tower32.vision(px, n_vit_h, n_vit_w)
            emb = tower32.aligner(hid, n_vit_h, n_vit_w)
            assert hid.dtype == emb.dtype == torch.float32
            r_h = rows_rel(hid, gold_blocks[f"vit_hidden.{i}"])
            r_e = rows_rel(emb, gold[f"image_embeds.{i}"])
            assert r_h.max() <= THR_FP32, f"vit_hidden.{i} rel {r_h.max():.3e}"
            assert r_e.max() <= THR_FP32, f"image_embeds.{i} rel {r_e.max():.3e}"
            assert rows_rel(emb, gold_blocks[f"image_embeds.{i}"]).max() <= THR_FP32


def test_merge_matches_embed_out(cfg, gold_blocks, tower32):
    ids, types, records, _ = im.expand_batch(json.loads((DATA / "input-seq0.json").read_text()), IMAGES, cfg)
    idx = json.loads((CKPT / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(CKPT / idx["embed.weight"]), framework="pt") as f:
        emb = f.get_tensor("embed.weight").float()
    h = emb[ids]
    calls = []

    def encode(patches, n_h, n_w):
        calls.append((n_h, n_w))
        return tower32.encode(patches, n_h, n_w)

    with torch.no_grad():
        out = vi.merge_image_embeddings(tower32, h, records, encode)
    assert out is h and calls == [(15, 29), (20, 16)]
    ref = gold_blocks["embed_out"]
    rel = rows_rel(h, ref)
    assert rel.max() <= THR_FP32, f"embed_out rel {rel.max():.3e} at row {int(rel.argmax())}"
    text = types[0] < 0
    assert torch.equal(h[0][text], ref[0][text])
    # delimiters carry the learned vectors exactly
    assert torch.equal(h[0][types[0] == im.IMAGE_NEW_LINE][0], tower32.image_newline.detach())


def test_merge_shared_image_encoded_once_and_checks(cfg, tower32, batch):
    ids, types, records, _ = batch
    h = torch.zeros(*ids.shape, cfg.dim)
    n = []

    def fake_encode(patches, n_h, n_w):
        n.append((n_h, n_w))
        return torch.ones(math.ceil(n_h / 3) * math.ceil(n_w / 3), cfg.dim)

    vi.merge_image_embeddings(tower32, h, records, fake_encode)
    assert len(n) == 2  # image 1 occurs in both rows
    assert torch.equal((h.abs().sum(-1) > 0), types >= 0)
    rec = records[0][0]
    with pytest.raises(ValueError):  # wrong number of aligner rows
        vi.merge_image_embeddings(tower32, h, [[rec]], lambda p, a, b: torch.ones(3, cfg.dim))
    late = im.ImageRecord(ids.shape[1] - 5, rec.patches, rec.n_vit_h, rec.n_vit_w, rec.types)
    with pytest.raises(ValueError):  # span past the end of the sequence
        vi.merge_image_embeddings(tower32, h, [[late]], tower32.encode)
    assert vi.merge_image_embeddings(None, h, None) is h
    # the model-member form (a model registering vision / aligner / image_* at top level) gives the same rows
    h1, h2 = torch.zeros(1, ids.shape[1], cfg.dim), torch.zeros(1, ids.shape[1], cfg.dim)
    with torch.no_grad():
        tower32.merge(h1, records[1:])
        vi.merge_image_embeddings(tower32, h2, records[1:])
    assert torch.equal(h1, h2) and h1.abs().sum() > 0


def test_bf16_official(cfg):
    ref = load_file(str(DATA / "v.bf16.official.safetensors"))
    t = vi.VisionTower(cfg, torch.bfloat16)
    vi.load_vision_weights(t, CKPT)
    with torch.no_grad():
        for i in range(2):
            n_vit_h, n_vit_w = ref["image_grid"][i, :2].tolist()
            emb = t.encode(ref[f"pixel_values.{i}"], n_vit_h, n_vit_w)
            assert emb.dtype == torch.bfloat16
            r = rows_rel(emb, ref[f"image_embeds.{i}"])
            assert r.max() <= THR_BF16, f"bf16 image_embeds.{i} rel {r.max():.3e}"


# ------------------------------------------------------------------------------------------------ 2D RoPE

@pytest.mark.parametrize("head_dim", [64, 32, 96])
def test_rope_2d_pairing(head_dim):
    theta = 10000.0
    rd = head_dim // 2  # rope dims per half
    q = rd // 2  # frequencies per axis
    n_h, n_w = 5, 7
    cos, sin = vi.vision_rope_table(n_h, n_w, rd, theta)
    assert cos.shape == (n_h * n_w, 1, rd)
    inv = [theta ** (-(2 * i) / rd) for i in range(q)]
    for d in (0, 1, q - 1, q, q + 1, rd - 1):
        x = torch.zeros(n_h * n_w, 1, head_dim, dtype=torch.float64)
        x[..., d] = 1.0
        y = vi.apply_rope_2d(x, cos, sin)
        for r, c in ((0, 0), (3, 1), (4, 6), (1, 5)):
            n = r * n_w + c
            pos = r if d < q else c  # first quarter follows the row, second the column
            ang = pos * inv[d % q]
            assert abs(y[n, 0, d].item() - math.cos(ang)) < 1e-5
            assert abs(y[n, 0, d + rd].item() - math.sin(ang)) < 1e-5  # partner is d + head_dim/2
            others = y[n, 0].clone()
            others[d] = others[d + rd] = 0
            assert others.abs().max().item() == 0.0
    # relative-position property: <R(p)a, R(p')b> depends only on p - p'
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, head_dim, generator=g, dtype=torch.float64)
    A = vi.apply_rope_2d(a.expand(n_h * n_w, 1, head_dim), cos, sin)[:, 0]
    B = vi.apply_rope_2d(b.expand(n_h * n_w, 1, head_dim), cos, sin)[:, 0]
    dot = lambda p1, p2: (A[p1[0] * n_w + p1[1]] * B[p2[0] * n_w + p2[1]]).sum().item()
    assert abs(dot((3, 4), (1, 2)) - dot((2, 3), (0, 1))) < 1e-4
    assert abs(dot((3, 4), (1, 2)) - dot((3, 4), (2, 1))) > 1e-3  # row and column offsets are not exchangeable


def _swapped_table(n_h, n_w, rope_dim, theta, device=None):
    cos, sin = vi._rope_table_cpu(n_h, n_w, rope_dim, theta)
    half = rope_dim // 2
    swap = lambda t: torch.cat([t[..., half:], t[..., :half]], dim=-1)  # row <-> column angles
    return swap(cos), swap(sin)


def _interleaved_rope(x, cos, sin):
    dtype = x.dtype
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]  # adjacent pairs instead of d, d + Dh/2
    y = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return y.to(dtype)


@pytest.mark.parametrize("variant", ["swap_row_col", "interleaved_pairs"])
def test_rope_negative_controls(variant, gold_blocks, gold, tower32, monkeypatch):
    if variant == "swap_row_col":
        monkeypatch.setattr(vi, "vision_rope_table", _swapped_table)
    else:
        monkeypatch.setattr(vi, "apply_rope_2d", _interleaved_rope)
    with torch.no_grad():
        for i in range(2):
            n_vit_h, n_vit_w = gold["image_grid"][i, :2].tolist()
            hid = tower32.vision(gold[f"pixel_values.{i}"], n_vit_h, n_vit_w)
            rel = rows_rel(hid, gold_blocks[f"vit_hidden.{i}"])
            assert rel.max() > 100 * THR_FP32, f"{variant} passed parity on image {i} ({rel.max():.3e})"


def test_pixel_unshuffle_order():
    # 4 x 5 grid, 2 channels, r = 3: padded to 6 x 6, 2 x 2 cells; feature (ch, kr, kc)
    n_h, n_w, C, r = 4, 5, 2, 3
    x = torch.arange(n_h * n_w * C, dtype=torch.float32).view(n_h * n_w, C) + 1
    y = vi.pixel_unshuffle(x, n_h, n_w, r)
    assert y.shape == (4, C * r * r)
    grid = x.view(n_h, n_w, C)
    for cell in range(4):
        cr, cc = divmod(cell, 2)
        for ch in range(C):
            for kr in range(r):
                for kc in range(r):
                    rr, col = cr * r + kr, cc * r + kc
                    want = grid[rr, col, ch].item() if rr < n_h and col < n_w else 0.0
                    assert y[cell, ch * r * r + kr * r + kc].item() == want
