"""The ragged step compiled ahead of time for a TPU v5e by libtpu's own compiler, on this host
(a TPU topology needs no TPU: `jax.experimental.topologies`): the programs a TPU server would
run compile, Pallas attention and the int8 AllReduce included, and int8 weights, per channel
or grouped, are read as int8 (no dequantized copy of any weight in the compiled program)."""
from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies

from equarx import AllReduceConfig
from models.gemma3 import ProgramKey, StepShape
from models.gemma3.config import get_config
from models.gemma3.programs import ModelPrograms
from models.gemma3.sharding import make_mesh

# The 270M's shapes with one period of layers (five sliding-window layers, one global).
CONFIG = get_config("270m").replace(num_layers=6)
DECODE = ProgramKey(StepShape(tokens=8, seqs=8, queries=1, global_pages=16, local_pages=16),
                    (65, 65, 16))


@pytest.fixture(scope="module")
def v5e():
    return topologies.get_topology_desc("v5e:2x2", "tpu").devices


def compiled(devices, tp, **settings):
    programs = ModelPrograms(CONFIG, mesh=make_mesh(tp, devices), allreduce=AllReduceConfig(),
                             dtype=jnp.bfloat16, **settings)
    assert programs.attention == "pallas"
    return programs, programs.lower(DECODE).compile().as_text()


def weight_shard_shapes(programs) -> set[str]:
    """"640,2,2048"-style shapes of one device's linear-layer weights."""
    shapes = set()
    for name in ("q", "kv", "o", "gating", "linear"):
        w = getattr(programs.abstract_weights.layers[0], name)
        codes = getattr(w, "codes", w)
        shard = codes.sharding.shard_shape(codes.shape)
        shapes.add(",".join(map(str, shard)))
    return shapes


def test_int8_weights_reach_the_tpu_mxu_as_int8(v5e):
    """tp=2, per-channel int8 weights, the default int8 AllReduce: each linear layer's product
    is one s8 x s8 -> s32 convolution (the MXU's int8 path), and no bfloat16 or float32 array
    of a weight shard's shape exists anywhere in the compiled program: the weights are read as
    int8, once, every step."""
    programs, text = compiled(v5e, 2, quantization="int8")
    n_linear = CONFIG.num_layers * 5
    int8_convs = re.findall(r"= s32\[[^\]]*\]\{[^}]*\} convolution\(", text)
    assert len(int8_convs) == n_linear
    for shape in weight_shard_shapes(programs):
        assert not re.search(rf"= (bf16|f32)\[{shape}\]", text), shape


def test_bfloat16_step_compiles_for_tpu(v5e):
    """The default setup (bfloat16 weights and pages, the Pallas ragged paged attention kernel,
    the int8 AllReduce at tp=2) compiles for a TPU; its products are bfloat16 convolutions."""
    _, text = compiled(v5e, 2)
    # One Pallas ragged paged attention kernel a layer.
    assert len(re.findall(r'custom_call_target="tpu_custom_call"', text)) == CONFIG.num_layers
    assert not re.search(r"= s32\[[^\]]*\]\{[^}]*\} convolution\(", text)


def test_grouped_int8_weights_reach_the_tpu_as_int8(v5e):
    """tp=2, int8 weights in groups of 32: each linear product is a Pallas kernel
    (`quantization.tpu_grouped_matmul`, beside one attention kernel a layer), and no bfloat16
    or float32 array of a weight shard's shape exists in the compiled program."""
    programs, text = compiled(v5e, 2, quantization="int8", quantization_group_size=32)
    kernels = len(re.findall(r'custom_call_target="tpu_custom_call"', text))
    assert kernels == CONFIG.num_layers * (1 + 5)
    for shape in weight_shard_shapes(programs):
        assert not re.search(rf"= (bf16|f32)\[{shape}\]", text), shape


def test_tpu_grouped_matmul_is_the_dequantized_product():
    """The kernel in interpret mode (on this CPU) gives XLA's dequantized product bit for bit,
    rows padded to its blocks and columns split into blocks, in bfloat16 and float32."""
    from models.gemma3.quantization import QuantizedArray, tpu_grouped_matmul

    rng = np.random.default_rng(0)
    for rows, c, n, dtype in ((3, 640, 4096, jnp.bfloat16), (300, 1024, 640, jnp.float32)):
        x = jnp.asarray(rng.standard_normal((rows, c)), dtype)
        w = QuantizedArray(jnp.asarray(rng.integers(-127, 128, (c, n)), jnp.int8),
                           jnp.asarray(rng.random((c // 32, n)) / 64, jnp.bfloat16))
        want = jnp.dot(x, w.dequantize(dtype), preferred_element_type=jnp.float32)
        got = tpu_grouped_matmul(x, w.codes, w.scale, interpret=True)
        np.testing.assert_array_equal(got, want)


def test_tpu_grouped_matmul_fits_a_v4s_vmem():
    """The kernel's blocks fit the 16 MiB of VMEM of a TPU v4 (the least of the generations) at
    the widest contraction the model gives it (`TPU_GROUPED_MAX_C`, dequantized in chunks) and
    at the 27B's widest output (its FFN's gate and up projections at tp 1), decode rows."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from models.gemma3.quantization import TPU_GROUPED_MAX_C, tpu_grouped_matmul

    v4 = topologies.get_topology_desc("v4:2x2x1", "tpu").devices
    one = NamedSharding(Mesh(np.array(v4[:1]), ("x",)), P())
    for rows, c, n in ((64, TPU_GROUPED_MAX_C, 5376), (8, 5376, 43008)):
        args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in
                (((rows, c), jnp.bfloat16), ((c, n), jnp.int8), ((c // 32, n), jnp.bfloat16))]
        text = jax.jit(tpu_grouped_matmul).lower(*args).compile().as_text()
        assert 'custom_call_target="tpu_custom_call"' in text
