"""The staged image encoder (serving/image_encoder.py) on the tiny multimodal golden: its
features equal the one-shot encoder's and transformers', no advance runs more than its budget,
images at the same stage share one program, and a running stream keeps decoding, one token a
step, while another request's image encodes."""
import threading

import numpy as np
import pytest

from serving.engine_core import EngineCore
from serving.image_encoder import ImageEncoder
from serving.paged_runner import PagedRunner
from serving.paged_scheduler import PagedScheduler
from serving.sampling import SamplingParams
from serving.sequence import Sequence
from testkit import stream_beside_an_image, vision_golden_images, vision_golden_model


@pytest.fixture(scope="module")
def model(vision_golden, tmp_path_factory):
    return vision_golden_model(vision_golden, tmp_path_factory.mktemp("hf_mm"))




def small_budget(m):
    """One block's rows for one image: the tower runs in 4 row blocks (each 1/4 of that, so
    that 4 images' stages fit together)."""
    from models.gemma3.vision import layer_flops
    return max(layer_flops(m.vision.config))


def test_staged_features_equal_the_one_shot_encoder_and_transformers(model, vision_golden):
    enc = ImageEncoder(model, long_prefill_token_threshold=8, budget_flops=small_budget(model))
    c = model.vision.config
    assert len(enc.stages) == 4 + c.num_layers * 2 * 4 + 1  # embed, 4 + 4 blocks a layer, finish
    images = vision_golden_images(model, vision_golden, 2) + vision_golden_images(model, vision_golden, 1)
    steps = 0
    while not all(enc.ready(im.key) for im in images):
        spent = enc.advance(images)
        steps += 1
        assert spent <= enc.budget_flops or len(enc.last_work) == 1
    assert enc.advances == steps and enc.max_advance_flops <= enc.budget_flops
    assert enc.max_program_frames == 3  # the three images ran each stage in one program
    assert steps >= len(enc.stages) // 2
    for k, found in ((2, images[:2]), (1, images[2:])):
        staged = np.stack([np.asarray(enc.features(im)) for im in found])
        one_shot = np.asarray(model.image_features(vision_golden[f"pixels_{k}"]))
        scale = np.abs(one_shot).max()
        assert np.abs(staged - one_shot).max() / scale < 2e-6
        assert np.abs(staged - vision_golden[f"features_{k}"]).max() / scale < 1e-4
    assert enc.images_encoded == 3


def test_deterministic_features_do_not_depend_on_what_encodes_beside(model, vision_golden):
    def run(images):
        enc = ImageEncoder(model, long_prefill_token_threshold=8, deterministic=True,
                           budget_flops=small_budget(model))
        while not all(enc.ready(im.key) for im in images):
            enc.advance(images)
        assert enc.max_program_frames == 1
        return np.asarray(enc.features(images[-1]))

    a = vision_golden_images(model, vision_golden, 1)
    np.testing.assert_array_equal(run(a), run(vision_golden_images(model, vision_golden, 2) + a))


def test_a_piece_stops_before_an_image_whose_features_are_not_ready(model, vision_golden):
    ids = vision_golden["ids_1"].tolist()
    image = vision_golden_images(model, vision_golden, 1)[0]
    a, b = image.spans[0]
    for deterministic in (False, True):
        engine = PagedRunner(model, max_num_seqs=2, max_seq_len=128, page_size=4, long_prefill_token_threshold=8,
                             deterministic=deterministic)
        sched = PagedScheduler(engine.info)
        ready = set()
        sched.image_ready = lambda key: key in ready
        seq = Sequence(id=0, prompt=list(ids), params=SamplingParams(max_tokens=1), seed=0,
                       images=(image,))
        sched.add([seq])
        ends = []
        for _ in range(3):
            plan = sched.schedule()
            ends += [p.end for p in plan.pieces]
            assert plan.encode == (image,)
        # normal mode: the text before the image runs; deterministic: its chunk waits whole
        assert ends == ([a] if not deterministic else list(range(8, a - a % 8 + 1, 8)))
        ready.add(image.key)
        plan = sched.schedule()
        assert plan.pieces[0].end >= b and plan.encode == ()


def test_a_running_stream_decodes_every_step_while_an_image_encodes(model, vision_golden):
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8)
    engine.encoder_budget_flops = small_budget(model)
    images = vision_golden_images(model, vision_golden, 2)
    tokens, seen = stream_beside_an_image(
        engine, vision_golden, images, lambda: [engine.images_encoded, engine.encoder.advances], 60)
    enc = engine.encoder
    assert enc.max_advance_flops <= enc.budget_flops
    np.testing.assert_array_equal(tokens, vision_golden["greedy_2"][:8])
    # Every advance while the image encoded came after a step that gave the stream a token.
    during = [adv for n, adv in seen if n < len(images) and 0 < adv]
    whole = sum(st.flops for st in enc.stages) * len(images)
    assert enc.advances >= whole / enc.budget_flops > 4  # the images took several steps
    assert len(set(during)) >= enc.advances - 2


@pytest.mark.parametrize("deterministic,whole_call", [(False, None), (False, 4), (True, None)])
def test_a_lone_image_request_has_nothing_to_stall(model, vision_golden, deterministic, whole_call):
    """With nothing else running, the images' stages run up to `whole_call_flops` at once (the
    tiny tower: whole in the first step that waits for them; a cap of 4 stages' FLOPs: in
    calls of at most that, never one past the step watchdog); in deterministic mode always by
    the bounded stages (the bits must not depend on the load)."""
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8,
                         deterministic=deterministic)
    engine.encoder_budget_flops = small_budget(model)
    calls = []
    if whole_call:
        engine.encoder.whole_call_flops = whole_call * engine.encoder.budget_flops
        advance = engine.encoder.advance
        engine.encoder.advance = lambda *a: calls.append(advance(*a)) or calls[-1]
    core = EngineCore(engine).start()
    done, got = threading.Event(), []

    def sink(e):
        got.extend(t.id for t in e.tokens)
        if e.finish_reason is not None:
            done.set()

    try:
        core.submit([(vision_golden["ids_2"].tolist(), SamplingParams(max_tokens=8, temperature=0.0,
                                                                ignore_eos=True),
                      sink, vision_golden_images(model, vision_golden, 2))])
        assert done.wait(120)
    finally:
        core.shutdown()
    np.testing.assert_array_equal(got, vision_golden["greedy_2"][:8])
    enc = engine.encoder
    assert engine.images_encoded == 2
    whole = sum(st.flops for st in enc.stages) * 2
    if deterministic:
        assert enc.advances >= whole / enc.budget_flops
    elif whole_call:
        assert max(calls) <= enc.whole_call_flops and len(calls) >= whole / enc.whole_call_flops
    else:
        # bounded advances only in the steps that also ran text (before each image)
        assert enc.advances <= 3 < whole / enc.budget_flops / 2


def test_a_waiting_image_stays_listed_while_other_pieces_run(model, vision_golden):
    """A running sequence that waits for its image keeps it in `encode`, every step until it
    is ready, while another prompt's pieces take every token of the steps."""
    engine = PagedRunner(model, max_num_seqs=2, max_seq_len=128, page_size=4, long_prefill_token_threshold=8,
                         max_num_batched_tokens=8)
    sched = PagedScheduler(engine.info)
    sched.image_ready = lambda key: False
    image = vision_golden_images(model, vision_golden, 1)[0]
    waits = Sequence(id=0, prompt=vision_golden["ids_1"].tolist(), params=SamplingParams(max_tokens=1),
                     seed=0, images=(image,))
    sched.add([waits])
    while waits.computed < image.spans[0][0]:
        assert sched.schedule().encode == (image,)
    long = Sequence(id=1, prompt=list(range(3, 80)), params=SamplingParams(max_tokens=1), seed=0)
    sched.add([long])
    for _ in range(4):
        plan = sched.schedule()
        assert [p.seq.id for p in plan.pieces] == [1] and plan.num_tokens == 8
        assert plan.encode == (image,)
