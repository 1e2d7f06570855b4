"""Chat templates (the official V4.1 encoding on fixed conversations, ours), reasoning effort and modes, the
output parser (reasoning / content / tool calls, streamed in pieces) and the usage helpers (no server)."""

from __future__ import annotations

import json

import pytest

from dsv41.engine.tokenizer import ByteTokenizer, HFTokenizer
from dsv41.server.chat import (OfficialTemplate, SimpleTemplate, chat_mode, effort_budget, effort_line, encode_prompt,
                               pick_template)
from dsv41.server.parsing import OutputParser
from dsv41.server.protocol import merge_usage, usage_from_stats

SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "hi"}
A1 = {"role": "assistant", "content": "hello", "reasoning_content": "greet back"}
U2 = {"role": "user", "content": "2+2?"}

EFF = "Reasoning Effort: {b} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def test_effort_mapping():
    # the release's encoder (as vLLM ports it): low / high / xhigh / max = 50 / 75 / 75 / 100, `none` = chat mode
    assert [effort_budget(e) for e in ("low", "high", "xhigh", "max")] == [50, 75, 75, 100]
    assert effort_budget(None) is None and effort_budget("none") is None
    assert effort_budget(1) == 1 and effort_budget(100) == 100
    for bad in ("medium", "minimal", "Low", "", 0, 101, -5, True, False, 50.0, [], {}):
        with pytest.raises(ValueError):
            effort_budget(bad)
    assert effort_line(75) == "Reasoning Effort: 75"


def test_chat_mode():
    assert chat_mode(None, None, True) == (True, 75)                  # official: thinking, `high` by default
    assert chat_mode("max", None, True) == (True, 100) and chat_mode(33, None, True) == (True, 33)
    assert chat_mode("none", None, True) == (False, None) and chat_mode("max", False, True) == (False, None)
    assert chat_mode("none", True, True) == (False, None) and chat_mode(None, True, True) == (True, 75)
    assert chat_mode(None, None, False) == (False, None) and chat_mode("low", None, False) == (False, 50)
    with pytest.raises(ValueError):
        chat_mode("medium", None, True)


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
    assert t.render([SYS, U1], effort=75, thinking=True) == (f"<｜System｜>{EFF.format(b=75)}Be brief.<｜User｜>hi"
                                                             "<｜Assistant｜><think>")
    assert t.render([U1], effort=100, thinking=True) == f"<｜System｜>{EFF.format(b=100)}<｜User｜>hi<｜Assistant｜><think>"
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
def test_parser_reasoning(pieces):
    sp = OutputParser(True, False)
    r = c = ""
    for p in pieces:
        d = sp.feed(p)
        r, c = r + d.reasoning, c + d.content
    d = sp.feed("", final=True)
    assert (r + d.reasoning, c + d.content) == ("abc", "answer") and sp.reasoning_chars == 3
    sp = OutputParser(True, False)
    d1, d2 = sp.feed("no end </thi"), sp.feed("", final=True)
    assert (d1.reasoning, d1.content, d2.reasoning) == ("no end ", "", "</thi")
    d = OutputParser(False, False).feed("plain </think>")
    assert (d.reasoning, d.content) == ("", "plain </think>")


CALLS = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
         '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
         '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
         '<｜DSML｜ invoke name="noop">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_parser_tool_calls_in_pieces(step):
    text = "hmm</think>Let me check.\n\n" + CALLS + " trailing text is dropped"
    sp = OutputParser(True, True)
    got = [sp.feed(text[i:i + step]) for i in range(0, len(text), step)] + [sp.feed("", final=True)]
    assert "".join(d.reasoning for d in got) == "hmm"
    assert "".join(d.content for d in got) == "Let me check."
    calls = [c for d in got for c in d.calls]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"] and sp.n_calls == 2
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1]["function"]["arguments"]) == {} and calls[0]["id"] != calls[1]["id"]
    # a block while still reasoning ends the reasoning; without tools the block is plain content
    d = OutputParser(True, True).feed("think " + CALLS, final=True)
    assert (d.reasoning, d.content, len(d.calls)) == ("think ", "", 2)
    d = OutputParser(False, False).feed(CALLS, final=True)
    assert d.content == CALLS and not d.calls


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
