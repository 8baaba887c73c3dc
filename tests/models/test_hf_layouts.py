"""Every layout transformers gives a Gemma3ForConditionalGeneration checkpoint loads, tower and
all, and answers images as transformers does; a checkpoint whose files do not hold what its
config.json declares is refused before anything loads, with the tensors named.

The layouts are the tiny multimodal golden's tensors (tests/golden/make_vision_golden.py,
transformers' state dict) renamed, so transformers is not needed here: `vision_tower.*` without
`vision_model.` is what transformers 5.25's `save_pretrained` writes."""
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from models.gemma3.hf_checkpoint import (CONFIG_FILE, HFCheckpointError, SafetensorsDir,
                                         hf_layout, write_safetensors)
from serving.sampling import SamplingParams
from testkit import finish_all, free_port, running_core, vision_golden_images

F32 = AllReduceConfig(method="f32")
# (text, tower, projector) prefixes, and a tied output head some writers store.
LAYOUTS = {
    "5.25-save": ("language_model.model.", "vision_tower.", "multi_modal_projector.", None),
    "published": ("language_model.model.", "vision_tower.vision_model.", "multi_modal_projector.",
                  "language_model.lm_head.weight"),
    "4.5x-state-dict": ("model.language_model.", "model.vision_tower.vision_model.",
                        "model.multi_modal_projector.", "lm_head.weight"),
    "5.x-state-dict": ("model.language_model.", "model.vision_tower.",
                       "model.multi_modal_projector.", None),
}
# The golden's own names (its state dict, transformers 5.24).
GOLDEN = ("model.language_model.", "model.vision_tower.", "model.multi_modal_projector.")


def golden_tensors(golden, layout=GOLDEN, head=None) -> dict[str, np.ndarray]:
    out = {}
    for key, value in golden.items():
        if not key.startswith("w:"):
            continue
        name = key[2:]
        for old, new in zip(GOLDEN, layout):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = value
    if head is not None:  # tied to the embedding
        out[head] = out[layout[0] + "embed_tokens.weight"]
    return out


def write(path, tensors, config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", tensors, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def layouts(vision_golden, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {name: write(root / name, golden_tensors(vision_golden, spec[:3], spec[3]),
                        str(vision_golden["config"]))
            for name, spec in LAYOUTS.items()}


@pytest.fixture(scope="module")
def reference(layouts):
    return load_model(layouts["5.x-state-dict"], dtype="float32", allreduce=F32)


def leaves(m):
    return jax.tree.leaves((m.weights, m.vision.vision, m.vision.projector))


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_finds_every_part(layouts, reference, vision_golden, name):
    """The prefixes come from the names stored, and the model read through them is the same,
    tensor for tensor, image token ids included; its tower's features are transformers'."""
    text, tower, projector, _ = LAYOUTS[name]
    found = hf_layout(layouts[name])
    assert (found.text, found.tower, found.projector) == (text, tower, projector)
    m = load_model(layouts[name], dtype="float32", allreduce=F32)
    assert m.takes_images and m.vision.tokens == reference.vision.tokens
    for a, b in zip(leaves(m), leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    feats = np.asarray(m.image_features(vision_golden["pixels_2"]))
    want = vision_golden["features_2"]
    assert np.abs(feats - want).max() / np.abs(want).max() < 1e-4


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_image_answers_equal_transformers_at_tp2(layouts, vision_golden):
    """The 5.25 layout served by the engine at tp=2 (float32, f32 AllReduce), as `gemma3-serve
    --tp 2` serves it: a prompt with two images answers the golden's greedy tokens, and the
    first token's top-5 logprobs are transformers' (they depend on the images' features)."""
    from serving.paged_runner import PagedRunner

    m = load_model(layouts["5.25-save"], tp=2, dtype="float32", allreduce=F32)
    engine = PagedRunner(m, max_num_seqs=4, max_seq_len=128, page_size=4,
                         long_prefill_token_threshold=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = (2,)
    with running_core(engine) as core:
        done = finish_all(core, [(vision_golden[f"ids_{k}"].tolist(), params,
                                  vision_golden_images(m, vision_golden, k)) for k in prompts])
    for k, sink in zip(prompts, done):
        assert sink.error is None, sink.error
        np.testing.assert_array_equal([t.id for t in sink.tokens], vision_golden[f"greedy_{k}"][:4])
        want = log_softmax(vision_golden[f"logits_{k}"][-1])
        top = sink.tokens[0].top
        np.testing.assert_allclose([lp for _, lp in top], want[[i for i, _ in top]], atol=1e-4)
        assert [i for i, _ in top] == list(np.argsort(-want)[:5])


def without(tensors, drop) -> dict:
    return {k: v for k, v in tensors.items() if not drop(k)}


@pytest.mark.parametrize("case,count,named", [
    ("no tower", 37, "vision_tower.vision_model.embeddings.patch_embedding.weight"),
    ("no layer 1", 16, "model.vision_tower.encoder.layers.1.layer_norm1.weight"),
    ("no projector", 2, "multi_modal_projector.mm_input_projection_weight"),
])
def test_a_declared_tower_that_is_not_all_stored_is_refused(vision_golden, tmp_path, case, count,
                                                            named):
    """config.json has a vision_config, its tensors are not all there: refused, naming a few of
    those missing and their count, never served as a text-only model."""
    drop = {"no tower": lambda k: ".vision_tower." in f".{k}",
            "no layer 1": lambda k: ".vision_tower.encoder.layers.1." in k,
            "no projector": lambda k: "multi_modal_projector" in k}[case]
    d = write(tmp_path, without(golden_tensors(vision_golden), drop), str(vision_golden["config"]))
    with pytest.raises(HFCheckpointError) as e:
        load_model(d, dtype="float32", allreduce=F32)
    part = "multimodal projector" if case == "no projector" else "vision tower"
    assert f"{count} of the {part}'s" in str(e.value)
    assert named in str(e.value) and "vision_config" in str(e.value)


def test_a_server_refuses_to_start_on_a_tower_it_lacks(vision_golden, tmp_path):
    """`gemma3-serve` itself (a real process) exits with status 1 and the missing tensors in its
    log, before it compiles anything."""
    d = write(tmp_path / "ckpt", without(golden_tensors(vision_golden), lambda k: "vision_tower" in k),
              str(vision_golden["config"]))
    done = subprocess.run([sys.executable, "-m", "serving.cli", "--model", d, "--tp", "2",
                           "--dtype", "float32", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "37 of the vision tower's 37 tensors are missing" in done.stderr
    assert "embeddings.patch_embedding.weight" in done.stderr


def test_stored_tensors_no_declared_part_uses_are_refused(vision_golden, tmp_path):
    """An extra text layer (config.json says 3) or an adapter's weights: the model would run
    without them, so it does not run."""
    tensors = golden_tensors(vision_golden)
    extra = dict(tensors)
    extra["model.language_model.layers.3.mlp.down_proj.weight"] = \
        tensors["model.language_model.layers.2.mlp.down_proj.weight"]
    extra["base_model.lora_A.weight"] = np.zeros((4, 64), np.float32)
    d = write(tmp_path, extra, str(vision_golden["config"]))
    with pytest.raises(HFCheckpointError, match="2 stored tensors belong to no part") as e:
        hf_layout(d)
    assert "base_model.lora_A.weight" in str(e.value)
    assert "model.language_model.layers.3.mlp.down_proj.weight" in str(e.value)


def test_a_text_only_config_over_a_multimodal_file_loads_text_only(vision_golden, tmp_path,
                                                                    caplog):
    """config.json declares a Gemma3ForCausalLM: the model loads as declared, the stored tower
    and projector are recognised, left out and said."""
    raw = json.loads(str(vision_golden["config"]))
    text = {**raw["text_config"], "architectures": ["Gemma3ForCausalLM"]}
    d = write(tmp_path, golden_tensors(vision_golden, LAYOUTS["published"][:3]), text)
    with caplog.at_level("WARNING"):
        m = load_model(d, dtype="float32", allreduce=F32)
    assert not m.takes_images
    assert "'vision_tower.vision_model.' is not loaded" in caplog.text
    assert "'multi_modal_projector.' is not loaded" in caplog.text


@pytest.mark.parametrize("files", [["pytorch_model.bin"],
                                   ["pytorch_model-00001-of-00002.bin",
                                    "pytorch_model-00002-of-00002.bin",
                                    "pytorch_model.bin.index.json"]])
def test_pickle_only_directories_say_how_to_convert(vision_golden, tmp_path, files):
    (tmp_path / CONFIG_FILE).write_text(str(vision_golden["config"]))
    for f in files:
        (tmp_path / f).write_bytes(b"\x80\x02")
    with pytest.raises(HFCheckpointError) as e:
        load_model(str(tmp_path), dtype="float32", allreduce=F32)
    message = str(e.value)
    assert all(f in message for f in files) and "safetensors" in message
    assert (f"t.Gemma3ForConditionalGeneration.from_pretrained('{tmp_path}', torch_dtype='auto')"
            f".save_pretrained('{tmp_path}')") in message


def test_convert_writes_the_layout_every_transformers_loads(reference, tmp_path):
    """`gemma3-convert --format hf` of a model with a tower: the published names, which
    transformers 4.50 holds as they are and 4.52-5.x map onto their modules."""
    from serving.cli import convert_main

    src = tmp_path / "src"
    reference.save(src, format="hf", dtype=np.float32)
    convert_main([str(src), str(tmp_path / "out"), "--format", "hf", "--dtype", "float32"])
    names = set(SafetensorsDir(tmp_path / "out").where)
    heads = {n.split(".")[0] + "." + n.split(".")[1] for n in names}
    assert heads == {"language_model.model", "vision_tower.vision_model",
                     "multi_modal_projector.mm_input_projection_weight",
                     "multi_modal_projector.mm_soft_emb_norm"}
    found = hf_layout(tmp_path / "out")
    assert (found.text, found.tower, found.projector) == LAYOUTS["published"][:3]
