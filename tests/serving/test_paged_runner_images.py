"""Images through the paged engine end to end (engine core, PagedScheduler, PagedRunner) on the
tiny multimodal golden (transformers' Gemma3ForConditionalGeneration on random weights, loaded
from its Hugging Face files): pieces never end inside an image, the encoder runs once per
distinct image, and the prefix cache never lends pages across different images."""

import numpy as np
import pytest

from serving.engine_core import EngineCore
from serving.kv_pages import block_hashes
from serving.paged_runner import PagedRunner
from serving.paged_scheduler import PagedScheduler
from serving.sampling import SamplingParams
from serving.sequence import SeqImage, Sequence
from testkit import finish_all, vision_golden_model


@pytest.fixture(scope="module")
def model(vision_golden, tmp_path_factory):
    return vision_golden_model(vision_golden, tmp_path_factory.mktemp("hf_mm"))


def images_of(m, vision_golden, k, order=None):
    """SeqImages of golden prompt k (one span each), optionally with its pixels reordered."""
    ids = vision_golden[f"ids_{k}"]
    soft = np.flatnonzero(ids == m.vision.tokens.soft)
    spans = [(int(a), int(a) + 16) for a in soft[::16]]
    pixels = vision_golden[f"pixels_{k}"]
    order = order or range(len(spans))
    return tuple(SeqImage(spans=(span,), pixels=pixels[j:j + 1], key=f"img{k}-{j}")
                 for span, j in zip(spans, order))


def generate(core, requests, max_tokens=32, logprobs=False):
    outs = finish_all(core, [(list(ids), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                        ignore_eos=True,
                                                        logprobs=0 if logprobs else None), images)
                             for ids, images in requests])
    for o in outs:
        assert o.error is None, o.error
    return [[(t.id, t.logprob) if logprobs else t.id for t in o.tokens] for o in outs]


def engine_of(m, **kw):
    args = dict(max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8)
    return PagedRunner(m, **{**args, **kw})


def test_pieces_run_past_the_chunk_to_an_images_end(model, vision_golden):
    engine = engine_of(model)
    sched = PagedScheduler(engine.info)
    ids = vision_golden["ids_2"].tolist()
    seq = Sequence(id=0, prompt=ids, params=SamplingParams(max_tokens=1), seed=0,
                   images=images_of(model, vision_golden, 2))
    sched.add([seq])
    ends = []
    while seq.computed < len(ids):
        plan = sched.schedule()
        ends += [p.end for p in plan.pieces]
    spans = seq.image_spans
    assert not any(a < e < b for e in ends for a, b in spans)
    assert max(np.diff([0] + ends)) > 8  # a piece ran past the chunk


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_equals_transformers_and_the_encoder_runs_once(model, vision_golden, k):
    engine = engine_of(model)
    core = EngineCore(engine).start()
    try:
        ids = vision_golden[f"ids_{k}"]
        first = generate(core, [(ids, images_of(model, vision_golden, k))])[0]
        encoded = engine.images_encoded
        again = generate(core, [(ids, images_of(model, vision_golden, k))] * 2)
    finally:
        core.shutdown()
    np.testing.assert_array_equal(first, vision_golden[f"greedy_{k}"])
    assert again == [first, first]
    assert encoded == k and engine.images_encoded == k  # the second and third: from the cache


def test_the_prefix_cache_never_shares_pages_across_images(model, vision_golden):
    m = model
    ids = vision_golden["ids_2"]
    swapped = images_of(m, vision_golden, 2, order=[1, 0])
    a = block_hashes(ids, 4, [(im.spans, im.key) for im in images_of(m, vision_golden, 2)])
    b = block_hashes(ids, 4, [(im.spans, im.key) for im in swapped])
    first_image_page = swapped[0].spans[0][0] // 4
    assert a[:first_image_page] == b[:first_image_page] and a[first_image_page] != b[first_image_page]
    engine = engine_of(m)
    core = EngineCore(engine).start()
    try:
        original = generate(core, [(ids, images_of(m, vision_golden, 2))], 4, True)[0]
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


def test_deterministic_mixed_text_and_image_requests_equal_each_alone(model, vision_golden):
    """Deterministic mode: one shape a step, and image spans written a layer at a time
    between steps whether a request runs alone or not, so a request's logprobs are
    bit-identical together and alone."""
    engine = engine_of(model, deterministic=True)
    text = vision_golden["ids_0"].tolist()
    requests = [(vision_golden["ids_2"], images_of(model, vision_golden, 2)), (text, ()),
                (vision_golden["ids_1"], images_of(model, vision_golden, 1))]
    core = EngineCore(engine).start()
    try:
        together = generate(core, requests, 6, True)
        alone = [generate(core, [r], 6, True)[0] for r in requests]
    finally:
        core.shutdown()
    assert together == alone
    # Staged, alone too: the first run's 3 spans at least (kv + one rows block a layer, the last
    # layer's kv only); the lone runs' spans may come from the prefix cache.
    assert engine.spans.stages_run >= 3 * (2 * model.config.num_layers - 1)
    np.testing.assert_array_equal([t for t, _ in together[0]], vision_golden["greedy_2"][:6])
