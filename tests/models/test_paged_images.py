"""Images through the paged engine's ragged step (models/gemma3/ragged.py `ImageRows`): the tiny
multimodal golden (tests/golden/make_vision_golden.py, transformers'
Gemma3ForConditionalGeneration on random weights) loaded from its Hugging Face files, tower
and all; prompts with 0, 1 and 2 images through ragged steps at tp=1 and tp=2 (float32, f32
AllReduce): every position's logits, the logits at the ends of pieces that never end inside an
image, and the greedy continuation the golden holds."""
import dataclasses

import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import StepShape, load_model
from models.gemma3 import multimodal as mm
from models.gemma3.ragged import ImageRows
from test_paged import Host, Piece  # the tests' page bookkeeping (tests/models/test_paged.py)
from testkit import vision_golden_checkpoint

F32 = AllReduceConfig(method="f32")
PROMPTS = (0, 1, 2)
PAGE, POOL = 3, 48


@pytest.fixture(scope="module")
def models(vision_golden, tmp_path_factory):
    path = vision_golden_checkpoint(vision_golden, tmp_path_factory.mktemp("hf_mm"))
    return {tp: load_model(str(path), tp=tp, dtype="float32", allreduce=F32) for tp in (1, 2)}


def rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def image_rows(m, vision_golden, k, ids, positions):
    """ImageRows for the tokens ids[positions] of prompt k: features from the model's tower."""
    if f"pixels_{k}" not in vision_golden:
        return None, None
    feats = np.asarray(m.image_features(vision_golden[f"pixels_{k}"])).reshape(-1, m.config.d_model)
    soft = np.asarray(ids) == m.vision.tokens.soft
    order = np.cumsum(soft) - 1  # the features row of each soft token, in prompt order
    return feats, np.where(soft, order, -1)[positions]


def visible(m, ids):
    spans = mm.image_spans(np.where(np.asarray(ids) == m.vision.tokens.soft,
                                    mm.IMAGE_SOFT_TOKEN_ID, 0))
    vis = np.arange(len(ids))
    for a, b in spans:  # an image's soft tokens see each other: up to its last one
        vis[a:b] = b - 1
    return vis, spans


def run(m, host, pages, pieces, bucket, vision_golden, k, ids, all_logits=False):
    t = bucket[0]
    batch = host.batch(pieces, bucket)
    if all_logits:  # one logits row per flat token: the spare rows read every position
        batch = dataclasses.replace(batch, last=np.arange(t, dtype=np.int32))
    images = None
    feats, index = image_rows(m, vision_golden, k, ids, np.arange(len(ids)))
    if feats is not None:
        flat = np.full(t, -1, np.int32)
        i = 0
        for p in pieces:  # (decode tokens lie past the prompt: text)
            got = index[p.start:p.start + len(p.tokens)]
            flat[i:i + len(got)] = got
            i += len(p.tokens)
        if (flat >= 0).any():
            images = ImageRows(features=feats, index=flat)
    logits, pages = m.ragged_step(pages, batch, images=images)
    return np.asarray(logits), pages


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("k", PROMPTS)
def test_all_logits_match_transformers(models, vision_golden, tp, k):
    m = models[tp]
    ids = vision_golden[f"ids_{k}"].tolist()
    vis, _ = visible(m, ids)
    host = Host(m.config, seed=k, page=PAGE, pages=POOL)
    pages = m.init_pages(POOL, POOL, PAGE)
    n = len(ids)
    bucket = (80, 80, 80, 32, -(-(8 - 1 + 80) // PAGE) + 1)
    logits, _ = run(m, host, pages, [Piece(0, tuple(ids), 0, tuple(vis))], bucket, vision_golden, k,
                    ids, all_logits=True)
    assert rel(logits[:n], vision_golden[f"logits_{k}"]) < 1e-4


def piece_ends(n, spans, chunk):
    """Piece ends every `chunk` tokens, moved past any image span they would cut."""
    ends, at = [], 0
    while at < n:
        end = min(n, at + chunk)
        for a, b in spans:
            if a < end < b:
                end = b
        ends.append(end)
        at = end
    return ends


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("k", PROMPTS)
def test_pieces_then_greedy_match_transformers(models, vision_golden, tp, k):
    """Pieces of 7 tokens (longer where an image would be cut), then decode steps: the logits
    at each piece's end and the 32 greedy tokens the golden holds."""
    m = models[tp]
    ids = vision_golden[f"ids_{k}"].tolist()
    vis, spans = visible(m, ids)
    host = Host(m.config, seed=10 + k, page=PAGE, pages=POOL)
    pages = m.init_pages(POOL, POOL, PAGE)
    bucket = (32, 1, 32, 40, -(-(8 - 1 + 32) // PAGE) + 1)
    start = 0
    for end in piece_ends(len(ids), spans, 7):
        piece = Piece(0, tuple(ids[start:end]), start, tuple(vis[start:end]))
        logits, pages = run(m, host, pages, [piece], bucket, vision_golden, k, ids)
        assert rel(logits[0], vision_golden[f"logits_{k}"][end - 1]) < 1e-4, (start, end)
        start = end
    out = [int(np.argmax(logits[0]))]
    step = (8, 1, 8, 40, -(-(8 - 1 + 8) // PAGE) + 1)
    while len(out) < 32:
        pos = len(ids) + len(out) - 1
        host.advance(0, pos)
        logits, pages = run(m, host, pages, [Piece(0, (out[-1],), pos)], step, vision_golden, k, ids)
        out.append(int(np.argmax(logits[0])))
    np.testing.assert_array_equal(out, vision_golden[f"greedy_{k}"])


def test_text_step_pays_nothing(models):
    """A step without images runs the text-only program (no features argument)."""
    m = models[1]
    assert m.takes_images and m.vision.tokens.soft == 502
    key = m.ragged_key(StepShape(8, 1, 8, 4, 4), m.init_pages(8, 8, PAGE))
    assert key.program.value == "ragged" and key.shape.features == 0
    key = m.ragged_key(StepShape(8, 1, 8, 4, 4, features=32), m.init_pages(8, 8, PAGE))
    assert key.program.value == "ragged_images"
