"""Chat templates, reasoning effort, the reasoning splitter and the usage helpers (no server)."""

from __future__ import annotations

import pytest

from dsv41.engine.tokenizer import ByteTokenizer, HFTokenizer
from dsv41.server.chat import (OfficialTemplate, ReasoningSplitter, SimpleTemplate, effort_budget, effort_line,
                               pick_template)
from dsv41.server.protocol import merge_usage, usage_from_stats

SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "hi"}
A1 = {"role": "assistant", "content": "hello", "reasoning_content": "greet back"}
U2 = {"role": "user", "content": "2+2?"}

EFF = "Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def test_effort_mapping():
    assert [effort_budget(e) for e in ("low", "high", "max")] == [50, 75, 100]
    assert effort_budget(None) is None and effort_budget(1) == 1 and effort_budget(100) == 100
    for bad in ("medium", "xhigh", "Low", "", 0, 101, -5, True, False, 50.0, [], {}):
        with pytest.raises(ValueError):
            effort_budget(bad)
    assert effort_line(75) == "Reasoning Effort: 75"


def test_simple_template():
    t = SimpleTemplate()
    assert t.render([U1]) == "User: hi\n\nAssistant:"
    assert t.render([SYS, U1]) == "Be brief.\n\nUser: hi\n\nAssistant:"
    assert t.render([SYS, U1], effort=75) == "Reasoning Effort: 75\nBe brief.\n\nUser: hi\n\nAssistant:"
    assert t.render([U1], effort=50) == "Reasoning Effort: 50\n\nUser: hi\n\nAssistant:"
    assert t.render([SYS, U1, A1, U2]) == "Be brief.\n\nUser: hi\n\nAssistant: hello\n\nUser: 2+2?\n\nAssistant:"
    assert t.render([U1, {"role": "assistant", "content": "Sure,"}]) == "User: hi\n\nAssistant: Sure,"
    with pytest.raises(ValueError):
        t.render([])
    with pytest.raises(ValueError):
        t.render([{"role": "assistant", "content": "x"}])


def test_official_template_chat_mode():
    t = OfficialTemplate()
    assert t.render([U1]) == "<｜User｜>hi<｜Assistant｜></think>"
    assert t.render([SYS, U1]) == "<｜System｜>Be brief.<｜User｜>hi<｜Assistant｜></think>"
    assert t.render([SYS, U1, A1, U2]) == ("<｜System｜>Be brief.<｜User｜>hi<｜Assistant｜></think>hello"
                                          "<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>")


def test_official_template_thinking_and_effort():
    t = OfficialTemplate()
    assert t.render([SYS, U1], effort=75) == (f"<｜System｜>{EFF.format(b=75)}Be brief.<｜User｜>hi"
                                              "<｜Assistant｜><think>")
    assert t.render([U1], effort=100) == f"<｜System｜>{EFF.format(b=100)}<｜User｜>hi<｜Assistant｜><think>"
    # thinking without an effort line; earlier turns drop their reasoning
    assert t.render([U1, A1, U2], thinking=True) == ("<｜User｜>hi<｜Assistant｜></think>hello<｜end▁of▁sentence｜>"
                                                     "<｜User｜>2+2?<｜Assistant｜><think>")
    # a final assistant message after the last user turn keeps its reasoning and is continued
    assert t.render([U1, A1], thinking=True) == "<｜User｜>hi<｜Assistant｜><think>greet back</think>hello"
    # effort only matters in thinking mode
    assert t.render([U1], effort=50, thinking=False) == "<｜User｜>hi<｜Assistant｜></think>"


def test_official_template_tools_and_mid_system():
    t = OfficialTemplate()
    msgs = [U1, {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}]
    assert t.render(msgs) == ("<｜User｜>hi\n\n<tool_result>r1</tool_result>\n\n<tool_result>r2</tool_result>"
                              "<｜Assistant｜></think>")
    msgs = [U1, {"role": "assistant", "content": "calling"}, {"role": "tool", "content": "r1"}]
    assert t.render(msgs) == ("<｜User｜>hi<｜Assistant｜></think>calling<｜end▁of▁sentence｜>"
                              "<｜User｜><tool_result>r1</tool_result><｜Assistant｜></think>")
    assert t.render([U1, A1, {"role": "system", "content": "new rule"}]) == (
        "<｜User｜>hi<｜Assistant｜></think>hello<｜end▁of▁sentence｜><｜System｜>new rule<｜Assistant｜></think>")


def test_pick_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    assert pick_template(ByteTokenizer(512)).name == "simple"
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    assert pick_template(hf).name == "deepseek-v4.1"
    assert pick_template(hf, "simple").name == "simple" and pick_template(ByteTokenizer(512), "official").name \
        == "deepseek-v4.1"
    ids = hf.encode(OfficialTemplate().render([U1]))
    assert ids[0] == hf.tok.token_to_id("<｜User｜>")                        # special tokens are single ids
    with pytest.raises(ValueError):
        pick_template(hf, "chatml")


@pytest.mark.parametrize("pieces", [["abc</think>answer"], ["ab", "c</th", "ink>ans", "wer"],
                                    ["abc<", "/", "t", "h", "i", "n", "k", ">", "answer"]])
def test_reasoning_splitter(pieces):
    sp = ReasoningSplitter(True)
    r = c = ""
    for p in pieces:
        dr, dc = sp.feed(p)
        r, c = r + dr, c + dc
    dr, dc = sp.feed("", final=True)
    assert (r + dr, c + dc) == ("abc", "answer")
    sp = ReasoningSplitter(True)
    assert sp.feed("no end </thi") == ("no end ", "") and sp.feed("", final=True) == ("</thi", "")
    assert ReasoningSplitter(False).feed("plain") == ("", "plain")


def test_usage_from_stats_reads_cache_fields_when_present():
    u = usage_from_stats({"prompt_tokens": 10, "generated_tokens": 4})
    assert u["prompt_tokens_details"] == {"cached_tokens": 0, "cached_tokens_by_tier": {}, "cache_path": "cold"}
    assert u["total_tokens"] == 14
    u = usage_from_stats({"prompt_tokens": 100, "generated_tokens": 1, "cached_tokens": 64, "cache_path": "replay",
                          "cached_tokens_by_tier": {"global": 64, "swa": 0}})
    assert u["prompt_tokens_details"] == {"cached_tokens": 64, "cached_tokens_by_tier": {"global": 64, "swa": 0},
                                          "cache_path": "replay"}
    u = usage_from_stats({"prompt_tokens": 100, "generated_tokens": 1, "cached_global_tokens": 48,
                          "cached_swa_tokens": 48, "cache_path": "swa-hit"})
    assert u["prompt_tokens_details"]["cached_tokens"] == 96 and u["prompt_tokens_details"]["cache_path"] == "swa-hit"
    assert u["prompt_tokens_details"]["cached_tokens_by_tier"] == {"global": 48, "swa": 48}


def test_merge_usage_counts_prompt_once():
    a = usage_from_stats({"prompt_tokens": 10, "generated_tokens": 3})
    b = usage_from_stats({"prompt_tokens": 10, "generated_tokens": 5, "cached_tokens": 8, "cache_path": "replay"})
    m = merge_usage([a, b], [10])
    assert (m["prompt_tokens"], m["completion_tokens"], m["total_tokens"]) == (10, 8, 18)
    assert m["prompt_tokens_details"]["cached_tokens"] == 8


def test_metrics_prefix_cache_series():
    from types import SimpleNamespace

    from dsv41.server.metrics import ServerMetrics
    from dsv41.server.runner import store_counters
    m = ServerMetrics()
    comp = SimpleNamespace(finish_reason="stop", stats={
        "prompt_tokens": 100, "generated_tokens": 5, "ttft_s": 0.1, "cached_tokens": 64, "cache_path": "replay",
        "cached_tokens_by_tier": {"global": 64, "swa": 0}})
    m.observe_completion(comp)
    counters = {"prefix_disk_hits": 3, "prefix_swa_misses": 1}
    engine = SimpleNamespace(prefix_cache=SimpleNamespace(metrics=lambda: counters))
    m.observe_engine(2, 1, {"global": 1000, "swa": 500}, store_counters(engine))
    text = m.render().decode()
    for line in ('dsv41_prefix_cache_hits_total{tier="global"} 64.0', "dsv41_prefix_cache_queries_total 100.0",
                 'dsv41_prefix_cache_requests_total{path="replay"} 1.0', "dsv41_prefix_cache_replays_total 1.0",
                 'dsv41_kv_bytes_in_use{kind="global"} 1000.0', 'dsv41_kv_bytes_peak{kind="swa"} 500.0',
                 'dsv41_prefix_store{name="prefix_disk_hits"} 3.0', "dsv41_running_sequences 2.0",
                 'dsv41_finished_sequences_total{reason="stop"} 1.0'):
        assert line in text, line
    assert store_counters(SimpleNamespace(prefix_cache=None)) == {}
