"""Images in chat messages: `image_url` content parts with `data:` URLs (PNG / JPEG, base64), through the model's
vision path (`dsv41.model.image`: the official preprocessing, each image an image-token span in the prompt).

The rendered prompt carries one `<｜deepseek_image｜>` placeholder per image (`chat`); `expand` encodes the text
between them and replaces each by its span. No URL is fetched: the server reaches no network, so `http(s)://`
images are a 400 like anything that is not a PNG or JPEG, and so is an image sent to a checkpoint without a vision
tower.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image

from dsv41.model.image import expand_prompt, open_image
from dsv41.server.chat import IMAGE, encode_prompt
from dsv41.server.protocol import bad_request

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}


def decode_image(url: str, param: str) -> bytes:
    """A `data:image/png|jpeg;base64,...` URL -> the image file's bytes (checked to be that kind of image)."""
    head, sep, data = url.partition(",")
    mime = head[len("data:"):].split(";")[0].lower()
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise bad_request(f"{param}: only data: URLs (data:image/png;base64,... or image/jpeg) are accepted; this "
                          f"server fetches nothing", param, "invalid_image_url")
    if mime not in FORMATS:
        raise bad_request(f"{param}: {mime or 'no'} media type; send PNG or JPEG", param, "invalid_image")
    try:
        raw = base64.b64decode(data, validate=True)
        open_image(raw)
        kind = Image.open(io.BytesIO(raw)).format
    except (ValueError, binascii.Error) as e:
        raise bad_request(f"{param}: not a readable image ({str(e)[:120]})", param, "invalid_image") from None
    if kind != FORMATS[mime]:
        raise bad_request(f"{param}: the data is {kind}, not {FORMATS[mime]}", param, "invalid_image")
    return raw


def expand(tokenizer, prompt: str, images: list[bytes], cfg) -> tuple[list[int], tuple]:
    """The prompt's ids with every placeholder replaced by its image's span, and (records, token types) for the
    engine."""
    pieces = prompt.split(IMAGE)
    if len(pieces) - 1 != len(images):
        raise bad_request(f"messages: {len(images)} images but {len(pieces) - 1} of them in the rendered prompt (an "
                          f"image in a message the format drops)", "messages")
    if not cfg.vision_enabled:
        raise bad_request("messages: this checkpoint has no vision tower; send text only", "messages",
                          "images_not_supported")
    items: list = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for k, piece in enumerate(pieces):
        items += ([{"image": k - 1}] if k else []) + encode_prompt(tokenizer, piece)
    try:
        ids, types, records = expand_prompt(items, images, cfg)
    except ValueError as e:
        raise bad_request(f"messages: {e}", "messages", "invalid_image") from None
    return ids.tolist(), (records, types)
