"""Images through the OpenAI chat API on a real HTTP server over the paged engine: a tiny random
model with a random tiny vision tower ("random:tiny?vision=tiny"), real PNG bytes made with
Pillow. A request with an image answers (plain and streamed, through the openai client), the
same image twice gives the same tokens with the encoder run once, every kind of bad image input
gets a 400 with a clear message, and the server answers a text request afterwards. Pan-and-scan
crops asked for per request equal a direct engine run of the reference processor's layout."""
import base64
import io
import re
import threading

import numpy as np
import openai
import pytest
from PIL import Image

from equarx import AllReduceConfig
from models.gemma3 import load_model
from serving import chat_images, media
from serving.config import ServerConfig
from serving.engine_core import EngineCore
from serving.paged_runner import PagedRunner
from serving.sampling import SamplingParams
from serving.sequence import SeqImage
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
    engine = PagedRunner(m, max_num_seqs=4, max_seq_len=256, page_size=4, long_prefill_token_threshold=8,
                         model_name="tiny-vl")
    config = ServerConfig(model=MODEL, served_model_name="tiny-vl", max_num_seqs=4,
                          max_seq_len=256, page_size=4, long_prefill_token_threshold=8, compile_cache_dir="")
    s = ServerThread(config, engine)
    yield s
    s.stop()


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


def test_an_image_to_a_text_only_model_is_refused():
    from serving.fake_runner import fake_paged_runner

    with pytest.raises(chat_images.ImageRequestError, match="no vision tower"):
        chat_images.check_allowed(fake_paged_runner(max_num_seqs=1, max_seq_len=32), 1, 4)


def test_typed_image_markers_stay_text():
    """Only the request's own sentinel becomes an image: text a user types never does."""
    from models.gemma3.byte_tokenizer import ByteTokenizer

    tok = chat_images.ImageTokenizer(ByteTokenizer(512), 500, 501, 502, 4)
    ids = tok.encode(f"a{tok.sentinel}b <start_of_image>")
    assert ids.count(502) == 4 and ids.count(500) == 1
    assert ids[:4] == ByteTokenizer(512).encode("a\n\n") + [500]


def direct_run(model, ids, image: SeqImage, n: int):
    """Greedy tokens and their logprobs of prompt `ids` with `image`, through an engine core of
    its own over the server's model (no HTTP, no chat code)."""
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=256, page_size=4, long_prefill_token_threshold=8)
    core = EngineCore(engine).start()
    got, done = [], threading.Event()

    def sink(e):
        got.extend(e.tokens)
        if e.finish_reason is not None:
            done.set()

    try:
        core.submit([(list(ids), SamplingParams(max_tokens=n, temperature=0.0, logprobs=0),
                      sink, (image,))])
        assert done.wait(120)
    finally:
        core.shutdown()
    return [t.id for t in got], [t.logprob for t in got]


def reference_ids(model, question: str, crops: int) -> list[int]:
    """The chat prompt of one user turn `question` + one image with `crops` crops, laid out by
    the reference processor's textual expansion (`multimodal.expand_image_placeholders`) and
    tokenized around the image tokens, which take the tiny tower's ids."""
    from models.gemma3 import multimodal as mm
    from serving.chat_template import render_chat

    tok, t = model.tokenizer, model.vision.tokens
    pieces = {mm.START_OF_IMAGE: t.start, mm.END_OF_IMAGE: t.end, mm.IMAGE_SOFT_TOKEN: t.soft}

    class Expanding:  # the template's tokenizer, expanding the image marker as the reference
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text):
            text = mm.expand_image_placeholders(text, [crops] if mm.START_OF_IMAGE in text else [],
                                                model.vision.config.tokens_per_image)
            ids = []  # the image tokens as the reference's added tokens split the text
            for piece in re.split(f"({'|'.join(map(re.escape, pieces))})", text):
                ids += [pieces[piece]] if piece in pieces else tok.encode(piece) if piece else []
            return ids

    return render_chat([("user", question + mm.START_OF_IMAGE)], Expanding())


def test_pan_and_scan_crops_through_the_api_equal_the_model_run_directly(server, client):
    """mm_processor_kwargs {"do_pan_and_scan": true} (vLLM's per-request field; the server's
    default is off): a wide image becomes the original and its crops, laid out as the reference
    processor lays them out, and the served tokens and logprobs equal a direct engine run of
    the reference layout with the same crops."""
    wide = png(7, size=(96, 32))
    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
    settings = media.PanAndScan(min_crop_size=16)
    size = server.runner.model.vision.config.image_size
    prepared = media.prepare_image(wide, size=size, pan_and_scan=settings)
    assert prepared.crops >= 2
    body = chat_body(image_part(data_url(wide)), logprobs=True, mm_processor_kwargs=kwargs)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    served = [c["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]]
    ids = reference_ids(server.runner.model, "What is in this picture?", prepared.crops)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    per = server.runner.model.vision.config.tokens_per_image
    spans = chat_images.soft_spans(ids, server.runner.model.vision.tokens.soft)
    assert [b - a for a, b in spans] == [per] * (1 + prepared.crops)
    image = SeqImage(spans=tuple(spans), pixels=prepared.pixels, key="direct")
    tokens, logprobs = direct_run(server.runner.model, ids, image, body["max_tokens"])
    text = server.runner.tokenizer.decode(tokens)
    assert r.json()["choices"][0]["message"]["content"] == text
    np.testing.assert_allclose(served, logprobs, rtol=1e-4, atol=1e-5)
    # Off by default: the same request without the kwargs has one image's tokens only.
    plain = client.post("/v1/chat/completions", json=chat_body(image_part(data_url(wide))))
    assert plain.json()["usage"]["prompt_tokens"] == len(
        reference_ids(server.runner.model, "What is in this picture?", 0))
    bad = client.post("/v1/chat/completions", json=chat_body(
        image_part(data_url(wide)), mm_processor_kwargs={"do_pan_and_scan": "yes"}))
    assert bad.status_code == 400 and "do_pan_and_scan" in bad.json()["error"]["message"]


def test_pan_and_scan_settings_of_the_server_and_the_request():
    """--mm-processor-kwargs sets the server's default, a request's mm_processor_kwargs win;
    unknown keys and ill-typed values are refused (a 400, or a startup error for the flag)."""
    on = ServerConfig(mm_processor_kwargs='{"do_pan_and_scan": true}', compile_cache_dir="")
    assert chat_images.pan_and_scan(on.processor_kwargs, None) == media.PanAndScan()
    assert chat_images.pan_and_scan(on.processor_kwargs, {"do_pan_and_scan": False}) is None
    assert chat_images.pan_and_scan(None, None) is None  # off by default
    assert chat_images.pan_and_scan(None, {"do_pan_and_scan": True,
                                           "pan_and_scan_max_num_crops": 2}) == media.PanAndScan(
        max_num_crops=2)
    for bad in ({"do_pan_and_scan": 1}, {"crops": True}, {"pan_and_scan_min_crop_size": 1.5}):
        with pytest.raises(chat_images.ImageRequestError):
            chat_images.pan_and_scan(None, bad)
    for flag in ('{"do_pan_and_scan": "yes"}', "not json", '{"size": 3}'):
        with pytest.raises(ValueError, match="mm_processor_kwargs"):
            ServerConfig(mm_processor_kwargs=flag, compile_cache_dir="")
