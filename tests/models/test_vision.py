"""The vision encoder, projector, loaders and prompt layout against transformers'
Gemma3ForConditionalGeneration on a tiny random config (tests/golden/make_vision_golden.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gemma3 import multimodal as mm
from models.gemma3.hf_checkpoint import CONFIG_FILE, HFWeights, read_config
from models.gemma3.projector import image_features
from models.gemma3.ragged import ImageRows, merge_image_rows
from models.gemma3.vision import VISION_CONFIGS, encode, random_vision_weights
from models.gemma3.projector import random_projector_weights
from models.gemma3.vision_checkpoint import (load_hf_vision, save_hf_multimodal,
                                             vision_from_official, vision_to_official)
from testkit import vision_golden_checkpoint

SOFT = 502
PROMPTS = range(4)


def _encoded(vm, pixels, **kw):
    """The encoder as one compiled program (not an eager op at a time)."""
    return jax.jit(lambda v, x: encode(v, x, vm.config, **kw))(vm.vision, pixels)


def rel(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def checkpoint(vision_golden, tmp_path_factory):
    """The golden's state dict as a Hugging Face directory (transformers 5.x names)."""
    return vision_golden_checkpoint(vision_golden, tmp_path_factory.mktemp("hf_mm"))


@pytest.fixture(scope="module")
def vm(checkpoint):
    return load_hf_vision(checkpoint)


def test_loader_reads_config_and_tokens(vm):
    assert vm.config.replace(name="siglip-tiny") == VISION_CONFIGS["tiny"]
    assert (vm.tokens.start, vm.tokens.end, vm.tokens.soft) == (500, 501, SOFT)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_features_match_transformers(vision_golden, vm, k):
    fn = jax.jit(lambda v, p, x: image_features(v, p, x, vm.config))
    got = fn(vm.vision, vm.projector, vision_golden[f"pixels_{k}"])
    assert got.shape == vision_golden[f"features_{k}"].shape
    assert rel(got, vision_golden[f"features_{k}"]) < 1e-4
    hidden = jax.jit(lambda v, x: encode(v, x, vm.config))(vm.vision, vision_golden[f"pixels_{k}"])
    assert rel(hidden, vision_golden[f"hidden_{k}"]) < 1e-4


def test_query_chunks_do_not_change_the_encoder(vision_golden, vm):
    x = vision_golden["pixels_2"]
    whole = _encoded(vm, x)
    chunked = _encoded(vm, x, query_chunk=16)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", PROMPTS)
def test_merged_embeddings_match_transformers(vision_golden, checkpoint, vm, k):
    c = read_config(checkpoint)
    table = HFWeights(checkpoint, c).view(None, "embed").read((slice(None), slice(None)), np.float32)
    ids = vision_golden[f"ids_{k}"]
    embeds = jax.jit(lambda t, i: t[i] * jnp.sqrt(jnp.float32(c.d_model)))(table, ids)
    if f"features_{k}" in vision_golden:
        feats = vision_golden[f"features_{k}"].reshape(-1, c.d_model)
        index = np.where(ids == SOFT, np.cumsum(ids == SOFT) - 1, -1).astype(np.int32)
        merged = jax.jit(lambda e, f, i: merge_image_rows(e[None], ImageRows(f, i))[0])(
            embeds, feats, index)
    else:
        merged = embeds
    assert rel(merged, vision_golden[f"embeds_{k}"]) < 1e-6


def test_text_part_of_the_checkpoint_loads(checkpoint, vision_golden):
    c = read_config(checkpoint)
    assert (c.vocab_size, c.d_model, c.num_layers) == (512, 64, 3)
    view = HFWeights(checkpoint, c).view(0, "q")
    assert view.shape == (64, 4, 16)


def test_text_only_checkpoint_has_no_vision(checkpoint, tmp_path):
    raw = json.loads((checkpoint / CONFIG_FILE).read_text())
    text = {**raw["text_config"], "architectures": ["Gemma3ForCausalLM"]}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(text))
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    assert load_hf_vision(tmp_path) is None


def test_hf_and_official_round_trips(checkpoint, vm, tmp_path):
    from models.gemma3.hf_checkpoint import place_hf
    from jax.sharding import Mesh

    c = read_config(checkpoint)
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    text = place_hf(checkpoint, c, jnp.float32, mesh, 1)
    save_hf_multimodal(tmp_path, text, c, vm)
    again = load_hf_vision(tmp_path)
    assert again.tokens == vm.tokens and again.config == vm.config
    for a, b in zip(jax.tree.leaves(again.vision) + jax.tree.leaves(again.projector),
                    jax.tree.leaves(vm.vision) + jax.tree.leaves(vm.projector)):
        np.testing.assert_array_equal(a, b)
    assert read_config(tmp_path) == c

    tree = vision_to_official(vm)
    nested = vision_from_official(tree, vm.config)
    flat = {"SigLiPFromPatches_0/siglip_encoder": tree["vision_encoder"]["siglip_encoder"],
            "transformer/embedder": tree["embedder"]}
    for back in (nested, vision_from_official(flat, vm.config)):
        for a, b in zip(jax.tree.leaves(back.vision) + jax.tree.leaves(back.projector),
                        jax.tree.leaves(vm.vision) + jax.tree.leaves(vm.projector)):
            np.testing.assert_array_equal(a, b)
    assert vision_from_official({"transformer": {}}, vm.config) is None


def test_tensor_parallel_encoder_matches(vision_golden, vm):
    """Heads and MLP units split over 2 devices, partial sums through equarx.all_reduce."""
    from models.gemma3.vision_sharding import encode_sharded, vision_mesh

    mesh = vision_mesh(2)
    got = encode_sharded(vm.vision, vision_golden["pixels_2"], vm.config, mesh)
    want = _encoded(vm, vision_golden["pixels_2"])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# The prompt side


def test_expansion_is_the_reference_processors():
    one = "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    assert mm.image_sequence() == one
    text = "<start_of_turn>user\n<start_of_image>What is it?<end_of_turn>\n"
    assert mm.expand_image_placeholders(text) == text.replace("<start_of_image>", one)
    pas = mm.expand_image_placeholders("<start_of_image>", crops=[2])
    assert pas == ("Here is the original image " + one + " and here are some crops to help you "
                   "see better " + one + " " + one)
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        mm.expand_image_placeholders("<start_of_image><start_of_image>", crops=[0])


def test_image_spans():
    soft = mm.IMAGE_SOFT_TOKEN_ID
    assert mm.image_spans([2, soft, soft, 7, soft]) == ((1, 3), (4, 5))
    assert mm.image_spans([2, 7]) == ()


def test_real_tokenizer_ids():
    """Gemma 3's vocabulary: the image tokens' ids, and "\\n\\n" merging as the reference's
    textual expansion merges it, through the server's image tokenizer."""
    from models.gemma3.gguf import default_gguf_path
    from models.gemma3.tokenizer import Tokenizer
    from serving.chat_images import ImageTokenizer

    tok = Tokenizer.from_gguf(default_gguf_path())
    assert tok.piece_to_id(mm.START_OF_IMAGE) == mm.START_OF_IMAGE_ID
    assert tok.piece_to_id(mm.END_OF_IMAGE) == mm.END_OF_IMAGE_ID
    assert tok.id_to_piece(108) == "\n\n"
    images = ImageTokenizer(tok, mm.START_OF_IMAGE_ID, mm.END_OF_IMAGE_ID, mm.IMAGE_SOFT_TOKEN_ID, 4)
    ids = images.encode("user\n" + images.sentinel + "Describe.")
    assert ids[:3] == tok.encode("user\n\n\n") + [mm.START_OF_IMAGE_ID]
    assert ids[-len(tok.encode("\n\nDescribe.")) - 1:] == [mm.END_OF_IMAGE_ID] + tok.encode("\n\nDescribe.")


def test_random_weights_run_at_full_width_shapes():
    c = VISION_CONFIGS["tiny"].replace(num_layers=1)
    v, p = random_vision_weights(c), random_projector_weights(c, 48)
    out = jax.jit(lambda v, p, x: image_features(v, p, x, c))(
        v, p, np.zeros((2, c.image_size, c.image_size, 3), np.float32))
    assert out.shape == (2, c.tokens_per_image, 48) and np.all(np.isfinite(out))
