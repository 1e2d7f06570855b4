"""Images in chat messages through the real `openai` client: `image_url` parts with PNG / JPEG `data:` URLs go
through the model's vision path (the answer's log-probabilities equal the model's own forward over the expanded
prompt, and depend on the pixels); anything that is not such an image, and images for a checkpoint without a
vision tower, are a 400 naming the field."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch
from PIL import Image

from dsv41.config import load_config
from dsv41.model.image import expand_prompt
from dsv41.model.init import random_model
from dsv41.model.loading import save_checkpoint
from dsv41.model.step import ForwardOptions
from test_server_fixtures import MODEL, make_checkpoint, openai_client, running_server


def data_url(color, fmt="PNG", size=(40, 28)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("dbg-img"), seed=8)       # the debug preset has a ViT
    with running_server(ckpt, exact=True, chat_template="official") as (handle, app):
        yield openai_client(handle), app.state.dsv41.engine


def first_logprob(client, url: str):
    r = client.chat.completions.create(model=MODEL, messages=message(url), max_tokens=1, temperature=0,
                                       logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True, "reasoning_effort": "none",
                                                                  "return_prompt": True})
    return r, r.choices[0].logprobs.content[0]


def test_image_reaches_the_model(served):
    client, engine = served
    red, lp_red = first_logprob(client, data_url((200, 30, 30)))
    _, lp_blue = first_logprob(client, data_url((20, 40, 220), "JPEG"))
    assert red.model_extra["prompt"] == ("<｜User｜>What is this?\n\n<｜deepseek_image｜><｜Assistant｜></think>")
    assert abs(lp_red.logprob - lp_blue.logprob) > 1e-6                         # the pixels matter
    # the same number from the model's own forward over the expanded prompt
    tok = engine.tokenizer
    head, tail = "<｜User｜>What is this?\n\n", "<｜Assistant｜></think>"
    raw = base64.b64decode(data_url((200, 30, 30)).split(",", 1)[1])
    ids, types, recs = expand_prompt([tok.bos_id] + tok.encode(head) + [{"image": 0}] + tok.encode(tail), [raw],
                                     engine.cfg)
    assert red.usage.prompt_tokens == ids.numel() > len(head) + 20               # the span is in the prompt
    from dsv41.model.cache import DenseCache
    with torch.no_grad():
        logits = engine.model(ids[None], DenseCache(engine.cfg, 1, engine.model.dtype),
                              opts=ForwardOptions(images=[recs], token_types=types[None])).logits[0, -1]
    want = torch.log_softmax(logits.float(), -1)
    got = [e.logprob for e in lp_red.top_logprobs]
    assert torch.allclose(torch.tensor(got), torch.topk(want, 5).values, atol=1e-4)
    assert abs(lp_red.logprob - float(want.max())) < 1e-4                      # greedy: the most likely token


def test_bad_images_are_400(served, tmp_path):
    client, _ = served
    not_png = "data:image/png;base64," + base64.b64encode(b"hello, not an image").decode()
    jpeg_as_png = data_url((1, 2, 3), "JPEG").replace("image/jpeg", "image/png")
    for url in (not_png, "data:image/png;base64,@@@", "https://example.com/cat.png", data_url((9, 9, 9), "GIF"),
                jpeg_as_png, "data:image/png,raw"):
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model=MODEL, messages=message(url), max_tokens=1)
        assert ei.value.body["param"] == "messages.0.content.1.image_url", (url[:40], ei.value.body)
    cfg = load_config("debug").replace(vision_n_layers=0)
    save_checkpoint(random_model(cfg, seed=0), cfg, tmp_path / "novit")
    with running_server(tmp_path / "novit") as (handle, _):
        with pytest.raises(openai.BadRequestError) as ei:
            openai_client(handle).chat.completions.create(model=MODEL, messages=message(data_url((1, 1, 1))),
                                                          max_tokens=1)
        assert ei.value.body["code"] == "images_not_supported"
