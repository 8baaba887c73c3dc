"""`gemma3-convert` with a vision tower, both ways on the tiny multimodal golden: Hugging Face
Gemma3ForConditionalGeneration -> the official `gemma` parameter tree -> Hugging Face again
keeps every tensor of the tower, the projector and the text, and the image token ids."""
import jax
import numpy as np

from equarx import AllReduceConfig
from models.gemma3 import load_model
from models.gemma3.hf_checkpoint import read_config
from models.gemma3.vision_checkpoint import vision_config_from_official
from serving.cli import convert_main
from testkit import vision_golden_checkpoint

F32 = AllReduceConfig(method="f32")


def assert_same_model(a, b):
    assert a.vision.config.replace(name="") == b.vision.config.replace(name="")
    assert a.vision.tokens == b.vision.tokens
    for x, y in ((a.vision.vision, b.vision.vision), (a.vision.projector, b.vision.projector),
                 (a.weights, b.weights)):
        for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            np.testing.assert_array_equal(np.asarray(p), np.asarray(q))


def test_hf_to_official_to_hf_keeps_the_tower(vision_golden, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    hf = vision_golden_checkpoint(vision_golden, tmp_path / "hf")
    convert_main([str(hf), str(tmp_path / "official"), "--format", "official",
                  "--dtype", "float32"])
    assert "wrote" in capsys.readouterr().out
    original = load_model(str(hf), dtype="float32", allreduce=F32)
    # The tiny text shapes match no official size: the official tree needs its config.
    official = load_model(str(tmp_path / "official"), dtype="float32", allreduce=F32,
                          config=read_config(hf))
    assert_same_model(original, official)
    official.save(tmp_path / "hf2", format="hf", dtype=np.float32)
    again = load_model(str(tmp_path / "hf2"), dtype="float32", allreduce=F32)
    assert_same_model(original, again)
    feats = np.asarray(again.image_features(vision_golden["pixels_1"]))
    scale = np.abs(vision_golden["features_1"]).max()
    assert np.abs(feats - vision_golden["features_1"]).max() / scale < 1e-4


def test_the_so400m_config_is_read_from_official_shapes():
    from models.gemma3.projector import random_projector_weights
    from models.gemma3.vision import VISION_CONFIGS, map_vision_weights
    from models.gemma3.vision_checkpoint import VisionModel, vision_to_official

    c = VISION_CONFIGS["so400m"]
    # Shapes only: zero-strided arrays of the right shapes cost no memory.
    shaped = map_vision_weights(c, lambda layer, name, shape: np.broadcast_to(np.float32(0), shape))
    tree = vision_to_official(VisionModel(c, shaped, random_projector_weights(c, 8)))
    got = vision_config_from_official(tree)
    assert got.replace(name="") == c.replace(name="") and got.tokens_per_image == 256
