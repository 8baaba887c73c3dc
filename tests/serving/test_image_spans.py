"""Image spans written a layer at a time between steps (serving/image_spans.py), on the tiny
multimodal golden: the keys and values equal those of the one-step piece, no advance runs more
than its budget, and through the engine core a running stream gets a token between the span's
stages while the image request's greedy tokens stay the golden's."""

import numpy as np
import pytest

from serving.paged_runner import PagedRunner
from serving.paged_steps import step_inputs
from serving.paged_scheduler import PagedScheduler
from serving.sampling import SamplingParams
from serving.sequence import Sequence
from testkit import stream_beside_an_image, vision_golden_images, vision_golden_model


@pytest.fixture(scope="module")
def model(vision_golden, tmp_path_factory):
    return vision_golden_model(vision_golden, tmp_path_factory.mktemp("hf_mm"))




def one_layer_rows(m) -> float:
    """A budget of half of one text layer's rows for a 16-token span (attending to at most
    the 128 positions of the engines below): 2 rows stages a layer."""
    from serving.image_spans import layer_flops
    return layer_flops(m.config, 16, 128)[1] / 2


def kv_after_prompt(model, vision_golden, staged: bool):
    """Runs a text sequence and the 2-image vision_golden prompt side by side (scheduler and engine
    driven by hand) until the image prompt samples its first token; returns its keys and
    values per layer [positions, 2 * Kc, H], and the writer."""
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8,
                         prefix_caching=False)
    engine.encoder_budget_flops = one_layer_rows(model)
    for im in vision_golden_images(model, vision_golden, 2):  # features ready: only the spans are staged
        engine.image_features(im)
    sched = PagedScheduler(engine.info)
    sched.image_ready = engine.image_ready
    sched.stage_spans, sched.span_written = staged, engine.span_written
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    text = Sequence(id=1, prompt=vision_golden["ids_0"].tolist(), params=params, seed=0)
    image = Sequence(id=2, prompt=vision_golden["ids_2"].tolist(), params=params, seed=0,
                     images=vision_golden_images(model, vision_golden, 2))
    sched.add([text, image])
    while not image.generated:
        plan = sched.schedule()
        if plan.pieces:
            out = engine.run_step(step_inputs(plan, sched.kv, engine.info))
            for row, p in enumerate(plan.pieces):
                if p.sample:
                    p.seq.generated.append(int(out.tokens[row]))
        if plan.spans:
            assert engine.advance_spans(plan.spans, sched.kv) <= engine.spans.budget_flops
    # Every position's keys in the global layers; in the local ones, the window's still held.
    sp, size = sched.kv.seqs[image.id], engine.info.page_size
    held = [pos for pos in range(len(image.prompt)) if pos // size >= sp.local_first]
    out = {}
    for layer, (pages, kind) in enumerate(zip(engine.pages.layers, engine.pages.kinds)):
        pool = np.asarray(pages.kv)
        flat = pool.reshape(-1, *pool.shape[2:])
        table, first = ((sp.global_pages, 0) if kind == "global"
                        else (sp.local_pages, sp.local_first))
        positions = range(len(image.prompt)) if kind == "global" else held
        out[layer] = flat[[table[pos // size - first] * size + pos % size for pos in positions]]
    return out, engine.spans


def test_staged_spans_store_the_one_step_pieces_keys(model, vision_golden):
    staged, writer = kv_after_prompt(model, vision_golden, staged=True)
    whole, unused = kv_after_prompt(model, vision_golden, staged=False)
    c = model.config
    # Both images' spans, each a layer at a time: kv + 2 rows stages a layer, the last
    # layer's keys only.
    assert writer.stages_run == 2 * (3 * c.num_layers - 2)
    assert unused.stages_run == 0
    # The stages donate their rows, never the cached features (a span of exactly a power of
    # two rows once took them): the image's next request finds them.
    for im in vision_golden_images(model, vision_golden, 2):
        assert not writer.engine.image_features(im).is_deleted()
    # float32 rounding: matmuls over 8 rows instead of the step's, through the layers
    # (measured: at most 1.6e-6 against values up to ~2.5).
    for layer in staged:
        scale = np.abs(whole[layer]).max()
        assert np.abs(staged[layer] - whole[layer]).max() <= 1e-5 * scale, layer


def test_a_running_stream_decodes_between_the_span_stages(model, vision_golden):
    """Through the engine core: the image request's greedy tokens are the golden's, and the
    span's stages ran spread over several steps, each after a step that gave the stream a
    token (counted, not timed)."""
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8)
    engine.encoder_budget_flops = one_layer_rows(model)
    for im in vision_golden_images(model, vision_golden, 2):  # features ready: only the spans are staged
        engine.image_features(im)
    tokens, seen = stream_beside_an_image(engine, vision_golden,
                                          vision_golden_images(model, vision_golden, 2),
                                          lambda: engine.spans.stages_run, 80)
    np.testing.assert_array_equal(tokens, vision_golden["greedy_2"][:8])
    writer = engine.spans
    assert writer.max_advance_flops <= writer.budget_flops
    total = 2 * (3 * model.config.num_layers - 2)
    assert writer.stages_run == total
    # The stream's tokens saw the stage count move in small steps: no token waited for more
    # than a budget's stages (here at most 2: kv is cheap, rows stages half a layer each).
    steps = np.diff([0] + sorted(set(seen)))
    assert len(steps) >= total // 2 and steps.max() <= 2


def test_when_the_scheduler_writes_a_span_between_steps(model, vision_golden):
    """Plain data: beside a running sequence a piece stops before an image's soft tokens and
    the plan lists the span every step until the engine says it is written, then the next
    piece starts at the span's end; a preempted sequence's span is dropped; a lone sequence
    runs the span inside its piece, except in deterministic mode."""
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8)
    image = vision_golden_images(model, vision_golden, 1)[0]
    (a, b), = image.spans
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def scheduler(*seqs):
        sched = PagedScheduler(engine.info)
        written = set()
        sched.stage_spans, sched.span_written = True, lambda job: job.seq.id in written
        sched.add(list(seqs))
        return sched, written

    def seq(i, images=(image,)):
        return Sequence(id=i, prompt=vision_golden["ids_1"].tolist(), params=params, seed=0,
                        images=images)

    other, s = seq(1, ()), seq(2)
    sched, written = scheduler(other, s)
    ends = []
    for _ in range(4):
        plan = sched.schedule()
        ends += [p.end for p in plan.pieces if p.seq is s]
        for p in plan.pieces:
            if p.sample:
                p.seq.generated.append(0)
    assert ends[-1] == a and [(j.seq, j.start, j.end) for j in plan.spans] == [(s, a, b)]
    written.add(s.id)
    plan = sched.schedule()
    assert plan.spans == () and [p.start for p in plan.pieces if p.seq is s] == [b]

    sched, written = scheduler(seq(1, ()), seq(2))
    while not (plan := sched.schedule()).spans:
        pass
    old, = plan.spans
    sched._preempt(old.seq)  # as when a running sequence needs its pages
    assert old not in sched.schedule().spans

    sched, _ = scheduler(seq(3))
    plan = sched.schedule()
    assert plan.spans == () and plan.pieces[0].end >= b

    # Deterministic mode stages the span alone too: the one-step piece rounds differently, and
    # a request's numbers must not depend on whether others run.
    engine = PagedRunner(model, max_num_seqs=4, max_seq_len=128, page_size=4, long_prefill_token_threshold=8,
                         deterministic=True)
    sched, written = scheduler(seq(4))
    while not (plan := sched.schedule()).spans:
        assert all(p.end <= a for p in plan.pieces)
    assert [(j.start, j.end) for j in plan.spans] == [(a, b)]
    written.add(4)
    assert [p.start for p in sched.schedule().pieces] == [b]


def test_a_lone_piece_run_on_past_an_image_fits_the_local_pool():
    """A lone prompt's whole-budget piece that ends inside an image's soft tokens runs on to the
    span's end: the local pool holds that longer piece's window (plain data; it used to preempt
    the sequence at the same place for ever, every later request waiting behind it)."""
    from models.gemma3 import load_model
    from serving.paged_runner import paged_runner_info
    from serving.sequence import SeqImage

    m = load_model("random:tiny?vision=tiny&max_len=1024", tp=1, dtype="float32")
    info = paged_runner_info(m, 1, 1024, 4, None, None, None, True, False, "t")  # pages of 4
    sched = PagedScheduler(info)
    sched.stage_spans = True
    n = m.vision.config.tokens_per_image
    a = info.max_num_batched_tokens * 2 - 7  # the second whole-budget piece ends inside the span
    prompt = [2] + [100 + i % 50 for i in range(1, 700)]
    prompt[a:a + n] = [m.vision.tokens.soft] * n
    s = Sequence(id=1, prompt=prompt, params=SamplingParams(max_tokens=2, temperature=0.0), seed=0,
                 images=(SeqImage(spans=((a, a + n),), pixels=None, key="img"),))
    sched.add([s])
    ends = []
    for _ in range(4):
        plan = sched.schedule()
        assert not plan.preempted
        ends += [p.end for p in plan.pieces]
        for p in plan.pieces:
            if p.sample:
                s.generated.append(5)
    assert ends[:3] == [256, a + n, len(prompt)]
