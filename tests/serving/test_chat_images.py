"""Images through the OpenAI chat API on a real HTTP server over the paged engine: a tiny random
model with a random tiny vision tower ("random:tiny?vision=tiny"), real PNG bytes made with
Pillow. A request with an image answers (plain and streamed, through the openai client), the
same image twice gives the same tokens with the encoder run once, every kind of bad image input
gets a 400 with a clear message, and the server answers a text request afterwards."""
import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving import chat_images
from serving.config import ServerConfig
from serving.paged_runner import PagedRunner
from testkit import ServerThread

MODEL = "random:tiny?vision=tiny"


def png(seed: int, size=(40, 30), mode="RGB") -> bytes:
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], len(mode)) if len(mode) > 1 else (size[1], size[0])
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_body(*parts, max_tokens=6, **kw) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"}, *parts]
    return {"model": "tiny-vl", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, **kw}


@pytest.fixture(scope="module")
def server():
    m = load_model(MODEL, tp=1, dtype="float32", allreduce=AllReduceConfig(method="f32"))
    engine = PagedRunner(m, max_num_seqs=4, max_seq_len=256, page_size=4, chunk_size=8,
                         model_name="tiny-vl")
    config = ServerConfig(model=MODEL, served_model_name="tiny-vl", engine="paged", max_batch=4,
                          max_seq_len=256, page_size=4, prefill_chunk=8, compile_cache_dir="")
    s = ServerThread(config, engine)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def test_models_say_the_model_takes_images(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]


def test_a_request_with_an_image_answers_and_repeats_exactly(server, client):
    before = server.runner.images_encoded
    r = client.post("/v1/chat/completions", json=chat_body(image_part(data_url(png(1)))))
    assert r.status_code == 200, r.text
    first = r.json()
    # 16 soft tokens + start/end of image around the text
    assert first["usage"]["prompt_tokens"] > 16 + 2
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = chat_body(image_part(data_url(png(1))))
    again = oai.chat.completions.create(model="tiny-vl", messages=body["messages"], max_tokens=6,
                                        temperature=0.0)
    assert again.choices[0].message.content == first["choices"][0]["message"]["content"]
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="tiny-vl", messages=body["messages"], max_tokens=6, temperature=0.0, stream=True)
        if c.choices)
    assert streamed == first["choices"][0]["message"]["content"]
    assert server.runner.images_encoded == before + 1  # the repeats read the features cache
    two = client.post("/v1/chat/completions", json=chat_body(image_part(data_url(png(1))),
                                                             image_part(data_url(png(2)))))
    assert two.status_code == 200, two.text
    assert two.json()["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 16


def _too_big_gif() -> bytes:
    """A GIF header claiming 10,000 x 10,000 pixels (refused before decoding)."""
    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, "GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = (10_000).to_bytes(2, "little") * 2
    return bytes(data)


BAD = {
    "not an image": (image_part(data_url(b"hello, this is text")), "not an image"),
    "truncated base64": (image_part(data_url(png(3))[:-5]), "base64"),
    "not base64": (image_part("data:image/png,rawbytes"), "base64"),
    "wrong media type": (image_part(data_url(png(3), "text/plain")), "image/*"),
    "remote url": (image_part("http://169.254.169.254/latest/meta-data"), "not allowed"),
    "missing url": ({"type": "image_url", "image_url": {}}, "missing"),
    "truncated png": (image_part(data_url(png(4)[:60])), "truncated"),
    "too many pixels": (image_part(data_url(_too_big_gif(), "image/gif")), "pixels"),
    "audio part": ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                   "only text and image_url parts"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_image_input_gets_400_then_text_still_answers(client, kind):
    part, words = BAD[kind]
    r = client.post("/v1/chat/completions", json=chat_body(part))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"].startswith("messages"), err
    ok = client.post("/v1/chat/completions", json={
        "model": "tiny-vl", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    assert ok.status_code == 200, ok.text


def test_more_images_than_the_limit_get_400(client):
    parts = [image_part(data_url(png(10 + i))) for i in range(5)]
    r = client.post("/v1/chat/completions", json=chat_body(*parts))
    assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]


def test_an_image_to_a_text_only_model_or_the_slot_engine_is_refused():
    from serving.fake_runner import FakeRunner

    with pytest.raises(chat_images.ImageRequestError, match="no vision tower"):
        chat_images.check_allowed(FakeRunner(num_slots=1, max_seq_len=32), 1, 4)

    class SlotEngine:  # a model with a tower behind the slot engine
        class model:
            vision = object()

        class info:
            page_size = 0

    with pytest.raises(chat_images.ImageRequestError, match="--engine paged"):
        chat_images.check_allowed(SlotEngine(), 1, 4)


def test_typed_image_markers_stay_text():
    """Only the request's own sentinel becomes an image: text a user types never does."""
    from models.gemma3.byte_tokenizer import ByteTokenizer

    tok = chat_images.ImageTokenizer(ByteTokenizer(512), 500, 501, 502, 4)
    ids = tok.encode(f"a{tok.sentinel}b <start_of_image>")
    assert ids.count(502) == 4 and ids.count(500) == 1
    assert ids[:4] == ByteTokenizer(512).encode("a\n\n") + [500]
