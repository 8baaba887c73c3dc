"""The on-disk cache of traced programs: a second model instance runs the stored programs
without tracing, gives bit-identical results, and never reuses a program across settings."""
import pickle
import shutil

import jax
import numpy as np
import pytest

from equarx import AllReduceConfig
from models.gemma3 import load_model
from models.gemma3.program_cache import SUFFIX

TINY = "random:tiny"
INT8 = AllReduceConfig(method="int8", pipelined=False)


def _score(model, long=False):
    """Every token's logits of two prompts (or one longer one: another step shape), through
    the ragged step's all-logits program."""
    return model.score([[2, 7, 9, 11, 13, 2, 8, 9, 10]] if long else [[2, 7, 9, 11], [2, 5, 6]])


def _run(model):
    """Two step shapes: two programs."""
    return [_score(model), _score(model, long=True)]


def _load(directory, allreduce=INT8, tp=2):
    return load_model(TINY, tp=tp, dtype="float32", allreduce=allreduce, max_seq_len=32,
                      program_cache_dir=directory)


def _stats(model):
    return dict(model.programs.program_cache.stats)


@pytest.fixture(scope="module")
def plain():
    """Results without a program cache."""
    return _run(_load(None))


@pytest.fixture(scope="module")
def stored(tmp_path_factory, plain):
    """A directory filled by one model instance (tp=2, int8 AllReduce), and its results."""
    directory = tmp_path_factory.mktemp("programs")
    model = _load(directory)
    results = _run(model)
    assert _stats(model) == {"exported": 2}
    assert len(list(directory.glob(f"*{SUFFIX}"))) == 2
    return directory, results


def test_second_instance_loads_programs_and_matches(stored, plain):
    directory, first = stored
    second = _load(directory)
    got = _run(second)
    assert _stats(second) == {"loaded": 2}
    for a, b, c in zip(plain, first, got, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_stored_int8_programs_call_the_native_cpu_kernels(stored):
    """The int8 AllReduce runs equarx's own FFI kernels on CPU (equarx.native_cpu: the encode
    with its sum, the all-gather's un-rotation into place): exported with those custom calls
    allowed, it is stored and loaded like any program."""
    from equarx import native_cpu

    modules = [jax.export.deserialize(bytearray(pickle.loads(p.read_bytes())[2])).mlir_module()
               for p in stored[0].glob(f"*{SUFFIX}")]
    for target in (native_cpu.ENCODE_TARGET, native_cpu.GATHER_TARGET):
        assert sum(target in m for m in modules) == 2


def test_grouped_int8_weights_programs_are_stored_with_their_kernel(tmp_path):
    """int8 weights in groups call the native CPU product (at tp=1, no AllReduce kernel):
    stored with that custom call, loaded by a second instance, the same bits."""
    from equarx import native_cpu

    def load():
        return load_model(TINY, tp=1, dtype="float32", max_seq_len=32, quantization="int8",
                          quantization_group_size=8, program_cache_dir=tmp_path)

    first = load()
    want = _score(first)
    assert _stats(first) == {"exported": 1}
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    module = jax.export.deserialize(bytearray(pickle.loads(path.read_bytes())[2])).mlir_module()
    assert native_cpu.MATMUL_TARGET in module
    second = load()
    np.testing.assert_array_equal(_score(second), want)
    assert _stats(second) == {"loaded": 1}


def test_other_settings_or_shapes_never_reuse_a_program(stored, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(stored[0], directory)
    other = _load(directory, allreduce=AllReduceConfig(method="f32"))
    _score(other)
    assert _stats(other) == {"exported": 1}
    single = _load(directory, tp=1)
    _score(single)
    _score(single, long=True)  # another step shape: another program
    assert _stats(single) == {"exported": 2}
    assert len(list(directory.glob(f"*{SUFFIX}"))) == 5


def test_unreadable_file_is_traced_again_and_replaced(stored, plain, tmp_path, caplog):
    directory = tmp_path / "copy"
    shutil.copytree(stored[0], directory)
    path = sorted(directory.glob(f"ragged_all-*{SUFFIX}"))[0]
    path.write_bytes(path.read_bytes()[:100])  # truncated
    model = _load(directory)
    got = _run(model)
    assert _stats(model) == {"loaded": 1, "unreadable": 1, "exported": 1}
    assert "cannot read" in caplog.text
    for a, b in zip(plain, got, strict=True):
        np.testing.assert_array_equal(a, b)
    _, _, blob = pickle.loads(path.read_bytes())  # rewritten whole
    assert jax.export.deserialize(bytearray(blob)).nr_devices == 2


def _key(model):
    """The step program of `_score`'s two prompts (T = 2 rows x 8, Q = 8, 8 pages a row)."""
    from models.gemma3 import ProgramKey, StepShape

    return ProgramKey.of(StepShape(16, 2, 8, 8, 8, every_token=True), model.pages_shapes(17, 17, 16))


def test_lowering_ahead_of_time_goes_through_the_cache(tmp_path):
    first = _load(tmp_path, tp=1)
    first.compile_ragged([_key(first)])
    model = _load(tmp_path, tp=1)
    model.compile_ragged([_key(model)])
    assert _stats(model) == {"loaded": 1}
    np.testing.assert_array_equal(_score(model), _score(_load(None, tp=1)))


def test_a_program_export_refuses_runs_uncached(tmp_path, caplog):
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from models.gemma3.program_cache import ProgramCache

    cache = ProgramCache(tmp_path)
    host_double = jax.jit(lambda x: jax.pure_callback(
        lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct((3,), jnp.float32), x))
    replicated = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("tp",)), P())
    program = cache.wrap("host_double", host_double, default_sharding=replicated)
    np.testing.assert_array_equal(program(np.ones(3, np.float32)), np.full(3, 2.0))
    np.testing.assert_array_equal(program(np.arange(3, dtype=np.float32)), [0.0, 2.0, 4.0])
    assert dict(cache.stats) == {"not_exportable": 1} and "cannot export" in caplog.text
    assert not list(tmp_path.glob(f"*{SUFFIX}"))


def test_outputs_fed_back_reuse_the_program(tmp_path):
    """Pages returned by a step (their sharding spelled differently: P() on a 1-device mesh)
    have the signature of the ones init_pages made: one stored program per step shape."""
    from models.gemma3.api import _score_batch

    model = _load(tmp_path, tp=1)
    pages = model.init_pages(17, 17, 16)
    batch = _score_batch([[2, 7, 9, 11], [2, 5, 6]], 2, 8, 8)
    for _ in range(3):  # first on init_pages's arrays, then on the step's own outputs
        _, _, pages = model.ragged_step(pages, batch, every_token=True)
    assert _stats(model) == {"exported": 1}
    assert len(model.programs.program_of(_key(model))._entries) == 1


# A fresh process (this one has the kernels loaded): a model whose AllReduce never calls the
# native CPU kernels (none at tp=1; XLA's psum at tp=2), loaded with a program cache and running
# its programs, must neither build nor load them (a first `gemma3-serve` at tp=1 used to wait
# ~16 s for a C++ build it never called).
_BUILDS_NOTHING = """
import sys
import numpy as np
from equarx import AllReduceConfig, native_cpu
from models.gemma3 import load_model
model = load_model("random:tiny", tp=int(sys.argv[2]), dtype="float32", max_seq_len=32,
                   allreduce=AllReduceConfig.from_label(sys.argv[3]), program_cache_dir=sys.argv[1])
model.score([[2, 7, 9]])
stats = model.programs.program_cache.stats
print("exported", stats["exported"], "kernels", native_cpu._load.cache_info().currsize)
"""


@pytest.mark.parametrize("tp,allreduce", [(1, "int8"), (2, "f32")])
def test_a_model_whose_allreduce_calls_no_kernel_never_builds_them(tmp_path, tp, allreduce):
    import os
    import subprocess
    import sys

    import jax_platform

    env = jax_platform.child_environment(dict(os.environ, JAX_PLATFORMS="cpu",
                                              EQUARX_CACHE_DIR=str(tmp_path / "kernels")),
                                         malloc_tunables=False, cpu_devices=tp)
    out = subprocess.run([sys.executable, "-c", _BUILDS_NOTHING, str(tmp_path / "programs"),
                          str(tp), allreduce],
                         env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == ["exported", "1", "kernels", "0"], out.stdout
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").iterdir())


def test_which_allreduces_use_the_group_codec():
    """`AllReduceConfig.group_codec`: the quantized methods with the group scales on the
    ppermute schedules, and nothing else."""
    uses = {label: AllReduceConfig.from_label(label).group_codec
            for label in ("int8", "int4", "fp8", "int8-semi", "int8-full+tile", "int8+hadamard",
                          "int8@pallas", "bf16_ring", "bf16", "f32")}
    assert uses == {"int8": True, "int4": True, "fp8": True, "int8-semi": True,
                    "int8-full+tile": False, "int8+hadamard": False, "int8@pallas": False,
                    "bf16_ring": False, "bf16": False, "f32": False}
