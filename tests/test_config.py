"""Guards the configuration layer: presets, both config.json spellings, validation errors, layer roles."""

import json

import pytest

from dsv41.config import PRESETS, Mode, ModelConfig, ced_split, layer_roles, load_config, role_summary
from tests.conftest import GOLDEN


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_validate(name):
    cfg = load_config(name)
    assert cfg.n_layers == len(layer_roles(cfg))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_v41_flash_roles():
    cfg = load_config("v41-flash")
    assert cfg == ModelConfig()  # the preset is exactly the released configuration
    s = role_summary(cfg)
    assert s["kv_source_layers"] == [2, 8, 14, 20]
    assert s["index_source_layers"] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert s["modes"] == {"swa": 2, "full": 4, "reindex": 4, "reuse": 30}
    roles = layer_roles(cfg)
    assert roles[5].mode == Mode.REUSE and roles[5].kv_from == 2 and roles[5].topk_from == 2
    assert roles[24].mode == Mode.REINDEX and roles[24].kv_from == 20 and roles[24].uses_candidates
    assert roles[25].topk_from == 24 and roles[25].kv_from == 20
    assert roles[20].is_candidate_source and roles[14].has_engram and roles[37].is_dspark_tap
    assert ced_split(cfg) == 20


def test_geometry_matches_flash_attention_geometry():
    f, g = load_config("v41-flash"), load_config("v41-geometry")
    for k in ("n_layers", "dim", "n_heads", "head_dim", "q_lora_rank", "index_n_heads", "index_head_dim",
              "index_topk", "window_size", "candidate_topk_blocks", "candidate_block_size", "compress_ratios",
              "kv_source_layers", "index_source_layers", "hc_mult", "o_groups", "o_lora_rank"):
        assert getattr(f, k) == getattr(g, k), k
    assert g.n_routed_experts < f.n_routed_experts
    assert sum(g.engram_num_embeddings) < sum(f.engram_num_embeddings) / 50


def test_tiny_keeps_every_structural_feature():
    cfg = load_config("tiny")
    roles = layer_roles(cfg)
    split = ced_split(cfg)
    enc, dec = roles[:split], roles[split:]
    assert [r.mode for r in enc[:2]] == [Mode.SWA_ONLY, Mode.SWA_ONLY]
    assert {r.mode for r in enc[2:]} == {Mode.FULL, Mode.REUSE} and all(r.ratio == 2 for r in enc[2:])
    assert dec[0].mode == Mode.FULL and dec[0].ratio == 1 and dec[0].is_candidate_source
    assert {r.mode for r in dec[1:]} == {Mode.REINDEX, Mode.REUSE}
    assert cfg.candidate_topk_blocks * cfg.candidate_block_size < 2048  # pool smaller than a few K tokens
    assert cfg.hc_mult == 4 and len(cfg.engram_layer_ids) == 2 and cfg.dspark_enabled
    assert cfg.n_routed_experts > cfg.n_activated_experts and cfg.n_shared_experts == 1


def test_golden_official_config_loads():
    cfg = load_config(GOLDEN / "case-a")
    assert cfg.n_layers == 13 and cfg.kv_source_layers == (2, 4, 6)
    assert role_summary(cfg)["modes"] == {"swa": 2, "full": 3, "reindex": 2, "reuse": 6}


def test_hf_spelling_maps_to_official():
    d = load_config("debug").to_dict()
    hf = dict(d)
    for official, hfkey in (("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads"),
                            ("moe_inter_dim", "moe_intermediate_size"), ("n_activated_experts", "num_experts_per_tok"),
                            ("norm_eps", "rms_norm_eps"), ("rope_head_dim", "qk_rope_head_dim")):
        hf[hfkey] = hf.pop(official)
    hf["rope_scaling"] = {"factor": hf.pop("rope_factor"), "original_max_position_embeddings": hf.pop("original_seq_len"),
                          "beta_fast": hf.pop("beta_fast"), "beta_slow": hf.pop("beta_slow"), "type": "yarn"}
    hf["architectures"] = ["DeepseekV41ForCausalLM"]
    assert ModelConfig.from_dict(hf) == ModelConfig.from_dict(d)


@pytest.mark.parametrize("change,field", [
    ({"bogus_field": 1}, "bogus_field"),
    ({"dim": -5}, "dim"),
    ({"dim": "big"}, "dim"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"kv_source_layers": [3]}, "kv_source_layers"),            # layer 2 (m=2) would have no KV source
    ({"compress_ratios": [0, 0, 2]}, "compress_ratios"),
    ({"n_activated_experts": 99}, "n_activated_experts"),
    ({"o_groups": 3}, "o_groups"),
    ({"candidate_source_layer": 3}, "candidate_source_layer"),
    ({"score_func": "relu"}, "score_func"),
    ({"head_dim": 48}, "head_dim"),
])
def test_bad_configs_name_the_field(change, field):
    d = load_config("debug").to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(d)


def test_hf_and_official_conflict_is_an_error():
    d = load_config("debug").to_dict()
    d["hidden_size"] = d["dim"] * 2
    with pytest.raises(ValueError, match="dim"):
        ModelConfig.from_dict(d)


def test_load_config_errors(tmp_path):
    with pytest.raises(ValueError, match="no such config"):
        load_config("nope")
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"dim": 64, "unknown_key": 1}))
    with pytest.raises(ValueError, match="unknown_key"):
        load_config(p)
