"""Weights: configs' shapes for every size (abstractly), the sharded layout's per-device share,
converted orbax checkpoints (save sharded, restore sharded at another tp), and official
Flax/orbax trees (nested and flat `transformer/...`)."""
import numpy as np
import pytest

import jax
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig
from models.gemma3 import CONFIGS, get_config, load_model
from models.gemma3.sharding import weight_specs
from models.gemma3.weights import to_official_tree, weight_shapes
from testkit import assert_same_bytes

F32 = AllReduceConfig(method="f32")

# Parameter counts of the published text models (embedding counted once: logits are tied).
OFFICIAL_PARAMS = {"270m": 268_098_176, "1b": 999_885_952, "4b": 3_880_099_328,
                   "12b": 11_765_788_416, "27b": 27_009_002_240}


def per_device_elements(config, tp: int) -> int:
    shapes = jax.tree.leaves(weight_shapes(config, np.float32))
    specs = jax.tree.leaves(weight_specs(config, tp), is_leaf=lambda x: isinstance(x, P))
    total = 0
    for shape, spec in zip(shapes, specs):
        n = int(np.prod(shape.shape))
        total += n // tp if "tp" in tuple(spec) else n
    return total


@pytest.mark.parametrize("size", sorted(OFFICIAL_PARAMS))
def test_every_size_has_the_official_shapes(size):
    c = CONFIGS[size]
    assert per_device_elements(c, 1) == OFFICIAL_PARAMS[size]
    assert c.num_global_layers == c.num_layers // 6
    assert [i for i in range(c.num_layers) if c.is_global(i)] == list(range(5, c.num_layers, 6))


def test_27b_at_tp16_holds_a_sixteenth_per_device():
    c = CONFIGS["27b"]
    share = per_device_elements(c, 16) / OFFICIAL_PARAMS["27b"]
    # Only norm scales (and q/k norms) stay replicated: a few per million.
    assert 1 / 16 <= share < 1 / 16 * 1.001, share


@pytest.mark.parametrize("every,layers", [(6, 8), (2, 3), (1, 2), (6, 2)])
def test_global_layers_follow_the_pattern(every, layers):
    c = get_config(f"tiny?global_every={every}&layers={layers}")
    assert [c.is_global(i) for i in range(layers)] == [i % every == every - 1 for i in range(layers)]
    with pytest.raises(ValueError, match="global_every"):
        get_config("tiny?global_every=0")


def test_config_specs():
    c = get_config("27b?layers=4&window=256")
    assert (c.num_layers, c.sliding_window, c.d_model) == (4, 256, 5376)
    assert c.name == "gemma3-27b?layers=4&window=256"
    with pytest.raises(ValueError, match="unknown config field"):
        get_config("1b?colour=blue")
    with pytest.raises(ValueError, match="bad value"):
        get_config("1b?layers=many")


@pytest.fixture(scope="module")
def reference():
    m = load_model("random:tiny", tp=2, dtype="float32", allreduce=F32, seed=3)
    seqs = [[2, 17, 99, 250, 3, 8, 77, 400, 12, 13, 14], [2, 5]]
    return m, seqs, m.score(seqs)


def test_orbax_round_trip_restores_sharded_at_another_tp(reference, tmp_path):
    m, seqs, expected = reference
    m.save(tmp_path / "ckpt")
    # Stored uncompressed (restores faster): at least the weights' own bytes on disk, where
    # orbax's default zstd stores this model in fewer.
    stored = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    assert stored >= sum(x.nbytes for x in jax.tree.leaves(m.weights))
    restored = load_model(str(tmp_path / "ckpt"), tp=4, dtype="float32", allreduce=F32)
    assert restored.config == m.config
    assert restored.weights.embed.addressable_shards[0].data.shape == (512 // 4, 64)
    for a, b in zip(jax.tree.leaves(m.weights), jax.tree.leaves(restored.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(restored.score(seqs), expected, atol=2e-5)
    # Restored in bfloat16: the values rounded from the float32 checkpoint.
    as_bf16 = load_model(str(tmp_path / "ckpt"), tp=1, dtype="bfloat16")
    q = np.asarray(as_bf16.weights.layers[2].q)
    assert q.dtype == np.dtype("bfloat16") == as_bf16.weights.embed.dtype
    np.testing.assert_array_equal(q, np.asarray(m.weights.layers[2].q).astype("bfloat16"))


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_official_orbax_checkpoint_loads(reference, tmp_path, layout):
    import orbax.checkpoint as ocp

    m, seqs, expected = reference
    tree = to_official_tree(m.weights, m.config)
    if layout == "nested":
        saved = {"transformer": tree}
    else:  # the flat form: {"transformer/layer_0/attn/q_einsum": {"w": ...}, ...}
        saved = {}
        for top, node in tree.items():
            for path, leaf in _leaves(node, ("transformer", top)):
                saved.setdefault("/".join(path[:-1]), {})[path[-1]] = leaf
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(tmp_path / "official", saved)
    # No config given: the size is recognised from the shapes.
    loaded = load_model(str(tmp_path / "official"), tp=2, dtype="float32", allreduce=F32)
    assert loaded.config == CONFIGS["tiny"]
    np.testing.assert_allclose(loaded.score(seqs), expected, atol=2e-5)


def test_official_tree_with_wrong_shapes_is_rejected(reference):
    m, _, _ = reference
    tree = to_official_tree(m.weights, m.config)
    tree["layer_2"]["mlp"]["linear"] = tree["layer_2"]["mlp"]["linear"][:, :32]
    with pytest.raises(ValueError, match="layer_2/mlp/linear has shape"):
        load_model(tree, config="tiny")
    tree = to_official_tree(m.weights, m.config)
    del tree["layer_2"]
    with pytest.raises(ValueError, match="layer_2/attn/q_einsum/w is missing"):
        load_model(tree, config="tiny")
    with pytest.raises(ValueError, match="match no known Gemma 3 size"):
        load_model(tree)


def _leaves(node, prefix):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, prefix + (k,))
    else:
        yield prefix, node


def _small_vocabulary(size: int) -> bytes:
    """A Gemma-shaped SentencePiece vocabulary of `size` pieces: the special ids where Gemma 3
    has them, byte-fallback pieces, and a few words."""
    from models.gemma3.tokenizer import build_model_proto

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(4, 105)]
    pieces += ["<start_of_turn>", "<end_of_turn>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁hello", "▁world", "▁the", "he", "ll", "lo"]
    pieces += words + [f"x{i}" for i in range(size - len(pieces) - len(words))]
    types = [3, 3, 3, 3] + [1] * 101 + [3, 3] + [6] * 256 + [1] * (size - 363)
    return build_model_proto(pieces, [0.0] * 363 + [-float(i) for i in range(size - 363)], types)


def test_checkpoint_carries_the_models_own_vocabulary(tmp_path):
    """A model's SentencePiece vocabulary is saved beside the weights and restored with them
    (so a checkpoint of any GGUF keeps that file's tokenizer); a model without one restores
    with the default."""
    from models.gemma3.tokenizer import Tokenizer

    m = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32)
    vocab = _small_vocabulary(m.config.vocab_size)
    m._tokenizer = Tokenizer(vocab)
    m.save(tmp_path / "with")
    restored = load_model(str(tmp_path / "with"), tp=1, dtype="float32", allreduce=F32)
    assert restored.tokenizer.serialized_model() == vocab
    ids = restored.tokenizer.encode("hello")
    assert ids == m.tokenizer.encode("hello") and restored.tokenizer.decode(ids) == "hello"

    plain = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32)
    plain.save(tmp_path / "without")
    assert not (tmp_path / "without" / "tokenizer.model").exists()
    again = load_model(str(tmp_path / "without"), tp=1, dtype="float32", allreduce=F32)
    assert type(again.tokenizer) is type(plain.tokenizer)


@pytest.mark.slow
def test_gemma3_convert_command_writes_a_checkpoint_of_the_real_weights(tmp_path):
    """`gemma3-convert gemma3-270m DIR` (a real process): DIR restores to the same bf16 weights
    and the GGUF's own tokenizer; a missing source is a usage error that writes nothing."""
    import subprocess
    import sys

    from models.gemma3.gguf import default_gguf_path
    from models.gemma3.tokenizer import Tokenizer

    exe = [sys.executable, "-c", "from serving.cli import convert_main; convert_main()"]
    done = subprocess.run(exe + ["gemma3-270m", str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "gemma3-serve --model" in done.stdout
    restored = load_model(str(tmp_path / "ckpt"))
    assert restored.tokenizer.serialized_model() == \
        Tokenizer.from_gguf(default_gguf_path()).serialized_model()
    direct = load_model("gemma3-270m")
    for a, b in zip(jax.tree.leaves(direct.weights), jax.tree.leaves(restored.weights)):
        assert_same_bytes(np.asarray(a), np.asarray(b))

    bad = subprocess.run(exe + [str(tmp_path / "missing.gguf"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not found" in bad.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["model", "json"])
def test_orbax_checkpoint_keeps_the_tokenizer_and_its_settings(tmp_path, kind):
    """Whatever its kind (SentencePiece, or only a tokenizer.json), the orbax format keeps the
    model's tokenizer with its EOS ids, chat template and sampling defaults, as "hf" does."""
    from models.gemma3.hf_tokenizer import (
        ChatTemplate, JsonTokenizer, tokenizer_json_from_sentencepiece)
    from models.gemma3.tokenizer import Tokenizer

    m = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32)
    proto = _small_vocabulary(m.config.vocab_size)
    tok = (Tokenizer(proto) if kind == "model"
           else JsonTokenizer(tokenizer_json_from_sentencepiece(proto)))
    tok.eos_ids = (1, 106, 7)
    tok.chat_template = ChatTemplate("{{ bos_token }}{{ messages[0]['content'] }}")
    tok.sampling_defaults = {"top_k": 64, "top_p": 0.95}
    m._tokenizer = tok
    m.save(tmp_path / "ckpt")
    back = load_model(tmp_path / "ckpt", tp=1, dtype="float32", allreduce=F32).tokenizer
    assert type(back) is type(tok)
    assert back.encode("hello world") == tok.encode("hello world") != []
    assert back.eos_ids == (1, 106, 7) and back.chat_template == tok.chat_template
    assert back.sampling_defaults == {"top_k": 64, "top_p": 0.95}


def test_a_save_replaces_the_checkpoint_in_its_directory(tmp_path):
    """Saving where a checkpoint already is (another format, more shards, a chat_template.jinja
    or tokenizer the new model lacks) removes the old checkpoint's files, which the loader would
    otherwise read before or with the new ones; files no checkpoint has stay, and a symlink
    among the old files is removed, never what it points to. What cannot be replaced without
    losing a file that is not ours is refused before anything is removed."""
    from models.gemma3.tokenizer import Tokenizer

    def embed(m):
        return np.asarray(m.weights.embed)

    def names(d):
        return sorted(p.name for p in d.iterdir())

    old = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32, seed=5)
    old._tokenizer = Tokenizer(_small_vocabulary(old.config.vocab_size))
    new = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32, seed=6)
    new_mm = load_model("random:tiny?vision=tiny", tp=1, dtype="float32", allreduce=F32, seed=7)
    d = tmp_path / "ckpt"
    old.save(d, format="hf", max_shard_bytes=200_000)  # shards, an index, tokenizer files
    (d / "chat_template.jinja").write_text("OLD TEMPLATE")
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (d / "special_tokens_map.json").symlink_to(outside)
    (d / "notes.txt").write_text("not a checkpoint file")

    new.save(d)  # orbax over hf
    back = load_model(d, tp=1, dtype="float32", allreduce=F32)
    np.testing.assert_array_equal(embed(back), embed(new))
    assert type(back.tokenizer) is type(new.tokenizer)  # not the old tokenizer files
    assert names(d) == ["gemma3_config.json", "notes.txt", "params"]
    assert outside.read_text() == "{}"

    old.save(d, format="hf", max_shard_bytes=200_000)
    new_mm.save(d, format="hf")  # one multimodal file over shards and their index
    back = load_model(d, tp=1, dtype="float32", allreduce=F32)
    np.testing.assert_array_equal(embed(back), embed(new_mm))
    assert back.takes_images
    assert names(d) == ["config.json", "model.safetensors", "notes.txt"]

    # A safetensors file we do not write, which the loader reads with ours: refused.
    (d / "adapter.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="adapter.safetensors"):
        new.save(d, format="hf")
    assert names(d) == ["adapter.safetensors", "config.json", "model.safetensors", "notes.txt"]
    (d / "adapter.safetensors").unlink()
    # The official format is orbax's own directory, which orbax replaces whole: refused while
    # the directory holds a file that is no checkpoint's.
    with pytest.raises(ValueError, match="notes.txt"):
        new.save(d, format="official")
    (d / "notes.txt").unlink()
    new.save(d, format="official")
    np.testing.assert_array_equal(embed(load_model(d, tp=1, dtype="float32", allreduce=F32)),
                                  embed(new))
    new.save(d, format="hf")  # over an official checkpoint
    assert names(d) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("format", ["hf", "orbax", "official"])
def test_a_save_that_fails_midway_leaves_the_old_checkpoint(tmp_path, monkeypatch, format):
    """A save raising once it wrote part of the new checkpoint (its first safetensors shard,
    orbax's params, the official tree): the directory still holds the old checkpoint, file for
    file, and loads as it; where there was none, there is still none; nothing stays beside."""
    from models.gemma3 import hf_checkpoint, loading

    old = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32, seed=5)
    new = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32, seed=6)
    d = tmp_path / "ckpt"
    old.save(d, format="hf", max_shard_bytes=200_000)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    module, name = {"hf": (hf_checkpoint, "write_safetensors"),
                    "orbax": (loading, "save_checkpoint"),
                    "official": (loading, "save_official_checkpoint")}[format]
    write = getattr(module, name)

    def write_then_fail(*args, **kwargs):
        write(*args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(module, name, write_then_fail)
    for target in (d, tmp_path / "fresh"):
        with pytest.raises(OSError, match="disk full"):
            new.save(target, format=format, max_shard_bytes=200_000)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    back = load_model(d, tp=1, dtype="float32", allreduce=F32)
    np.testing.assert_array_equal(np.asarray(back.weights.embed), np.asarray(old.weights.embed))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_save_killed_midway_leaves_the_old_checkpoint(tmp_path):
    """A process killed (SIGKILL) while it writes the new checkpoint's second shard: the
    directory still loads as the old checkpoint; the next save clears what the killed one
    left beside it and replaces the checkpoint."""
    import signal
    import subprocess
    import sys

    old = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32, seed=5)
    d = tmp_path / "ckpt"
    old.save(d, format="hf", max_shard_bytes=200_000)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    script = f"""
import os, signal
from equarx import AllReduceConfig
from models.gemma3 import hf_checkpoint, load_model
write, calls = hf_checkpoint.write_safetensors, []
def killed_on_the_second(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    write(*args, **kwargs)
hf_checkpoint.write_safetensors = killed_on_the_second
m = load_model("random:tiny", dtype="float32", allreduce=AllReduceConfig(method="f32"), seed=6)
m.save({str(d)!r}, format="hf", max_shard_bytes=200_000)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    left = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert len(left) == 1 and left[0].startswith(".ckpt.partial-")
    back = load_model(d, tp=1, dtype="float32", allreduce=F32)
    np.testing.assert_array_equal(np.asarray(back.weights.embed), np.asarray(old.weights.embed))

    new = load_model("random:tiny", tp=1, dtype="float32", allreduce=F32, seed=6)
    new.save(d, format="hf", max_shard_bytes=200_000)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    back = load_model(d, tp=1, dtype="float32", allreduce=F32)
    np.testing.assert_array_equal(np.asarray(back.weights.embed), np.asarray(new.weights.embed))
