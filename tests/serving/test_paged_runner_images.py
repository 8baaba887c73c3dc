"""Images through the paged engine end to end (engine core, PagedScheduler, PagedRunner) on the
tiny multimodal golden (transformers' Gemma3ForConditionalGeneration on random weights, loaded
from its Hugging Face files): pieces never end inside an image, the encoder runs once per
distinct image, and the prefix cache never lends pages across different images."""
import threading

import numpy as np
import pytest

from serving.engine_core import EngineCore
from serving.kv_pages import block_hashes
from serving.paged_runner import PagedRunner
from serving.paged_scheduler import PagedScheduler
from serving.sampling import SamplingParams
from serving.scheduler import SeqImage, Sequence
from testkit import VISION_GOLDEN_NPZ, vision_golden_model



@pytest.fixture(scope="module")
def golden():
    return dict(np.load(VISION_GOLDEN_NPZ))


@pytest.fixture(scope="module")
def model(golden, tmp_path_factory):
    return vision_golden_model(golden, tmp_path_factory.mktemp("hf_mm"))


def images_of(m, golden, k, order=None):
    """SeqImages of golden prompt k (one span each), optionally with its pixels reordered."""
    ids = golden[f"ids_{k}"]
    soft = np.flatnonzero(ids == m.vision.tokens.soft)
    spans = [(int(a), int(a) + 16) for a in soft[::16]]
    pixels = golden[f"pixels_{k}"]
    order = order or range(len(spans))
    return tuple(SeqImage(spans=(span,), pixels=pixels[j:j + 1], key=f"img{k}-{j}")
                 for span, j in zip(spans, order))


def generate(core, requests, max_tokens=32, logprobs=False):
    results, done = {}, []
    for i, (ids, images) in enumerate(requests):
        ev, got = threading.Event(), []

        def sink(e, got=got, ev=ev, i=i):
            got.extend((t.id, t.logprob) if logprobs else t.id for t in e.tokens)
            if e.finish_reason is not None:
                results[i] = (e.error, got)
                ev.set()

        core.submit([(list(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True, logprobs=0 if logprobs else None),
                                  sink, images)])
        done.append(ev)
    for ev in done:
        assert ev.wait(120)
    for error, _ in results.values():
        assert error is None, error
    return [results[i][1] for i in range(len(requests))]


def engine_of(m, **kw):
    args = dict(max_num_seqs=4, max_seq_len=128, page_size=4, chunk_size=8)
    return PagedRunner(m, **{**args, **kw})


def test_pieces_run_past_the_chunk_to_an_images_end(model, golden):
    engine = engine_of(model)
    sched = PagedScheduler(engine.info)
    ids = golden["ids_2"].tolist()
    seq = Sequence(id=0, prompt=ids, params=SamplingParams(max_tokens=1), seed=0,
                   images=images_of(model, golden, 2))
    sched.add([seq])
    ends = []
    while seq.computed < len(ids):
        plan = sched.schedule()
        ends += [p.end for p in plan.pieces]
    spans = seq.image_spans
    assert not any(a < e < b for e in ends for a, b in spans)
    assert max(np.diff([0] + ends)) > 8  # a piece ran past the chunk


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_equals_transformers_and_the_encoder_runs_once(model, golden, k):
    engine = engine_of(model)
    core = EngineCore(engine).start()
    try:
        ids = golden[f"ids_{k}"]
        first = generate(core, [(ids, images_of(model, golden, k))])[0]
        encoded = engine.images_encoded
        again = generate(core, [(ids, images_of(model, golden, k))] * 2)
    finally:
        core.shutdown()
    np.testing.assert_array_equal(first, golden[f"greedy_{k}"])
    assert again == [first, first]
    assert encoded == k and engine.images_encoded == k  # the second and third: from the cache


def test_the_prefix_cache_never_shares_pages_across_images(model, golden):
    m = model
    ids = golden["ids_2"]
    swapped = images_of(m, golden, 2, order=[1, 0])
    a = block_hashes(ids, 4, [(im.spans, im.key) for im in images_of(m, golden, 2)])
    b = block_hashes(ids, 4, [(im.spans, im.key) for im in swapped])
    first_image_page = swapped[0].spans[0][0] // 4
    assert a[:first_image_page] == b[:first_image_page] and a[first_image_page] != b[first_image_page]
    engine = engine_of(m)
    core = EngineCore(engine).start()
    try:
        original = generate(core, [(ids, images_of(m, golden, 2))], 4, True)[0]
        got = generate(core, [(ids, swapped)], 4, True)[0]
    finally:
        core.shutdown()
    fresh = generate_alone(engine_of(m, prefix_caching=False), ids, swapped)
    # (the tiny random model's greedy tokens are all the same: its logprobs tell images apart)
    np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in fresh], rtol=0, atol=1e-5)
    assert np.abs(np.array([lp for _, lp in got]) - [lp for _, lp in original]).max() > 1e-3


def generate_alone(engine, ids, images):
    core = EngineCore(engine).start()
    try:
        return generate(core, [(ids, images)], 4, True)[0]
    finally:
        core.shutdown()


def test_deterministic_mixed_text_and_image_requests_equal_each_alone(model, golden):
    """Deterministic mode: one shape a step (grown to hold a piece that runs to an image's
    end), so a request's logprobs are bit-identical together and alone."""
    engine = engine_of(model, deterministic=True)
    text = golden["ids_0"].tolist()
    requests = [(golden["ids_2"], images_of(model, golden, 2)), (text, ()),
                (golden["ids_1"], images_of(model, golden, 1))]
    core = EngineCore(engine).start()
    try:
        together = generate(core, requests, 6, True)
        alone = [generate(core, [r], 6, True)[0] for r in requests]
    finally:
        core.shutdown()
    assert together == alone
    np.testing.assert_array_equal([t for t, _ in together[0]], golden["greedy_2"][:6])
