"""The Pallas ring kernel (equarx.pallas_ring) and the multi-axis schedule through kernels
(equarx.pallas_torus): the config spelling, what they cover, their VMEM bound, and, in child
processes (a device count each, see tests/equarx/pallas_sweep.py), TPU interpret mode on rings of 2 and 4
devices and the 2x2, 2x4 and 2x2x2 tori against the same schedule through equarx.ring
(bitwise, race detector, semaphores at exit, both DMA modes) and the lowering for TPU for the
models' messages (tp 2-16, and the 2x4 and 2x2x4 tori).

The interpret cases are small (interpret mode costs seconds per call); `python
tests/equarx/pallas_sweep.py` runs every codec x dtype x DMA mode x device count and every model message.
"""
import pytest

from equarx import AllReduceConfig
import pallas_sweep as check


@pytest.mark.parametrize("label", ["int8@pallas", "int8-full+tile@pallas", "bf16_ring@pallas",
                                   "bf16_ring-full@pallas", "int8-full/64@pallas"])
def test_label_spells_the_kernel(label):
    cfg = AllReduceConfig.from_label(label, minishards=8)
    assert cfg.impl == "pallas" and cfg.label == label and cfg.minishards == 8
    assert AllReduceConfig.from_label(label.removesuffix("@pallas")).impl == "ppermute"


@pytest.mark.parametrize("label", ["bf16@pallas", "f32@pallas", "int8@ppermute", "int8@",
                                   "int8@tpu", "int8@pallas+tile"])
def test_label_rejects_bad_impls(label):
    with pytest.raises(ValueError):
        AllReduceConfig.from_label(label)


@pytest.mark.parametrize("label", ["int8-semi@pallas", "int8-twoshot@pallas", "int8-rs@pallas",
                                   "int4@pallas", "fp8@pallas", "int8+hadamard@pallas",
                                   "bf16_ring-semi@pallas"])
def test_kernel_refuses_what_it_does_not_cover(label):
    from equarx import pallas_ring

    with pytest.raises(ValueError, match="Pallas kernel"):
        pallas_ring.plan_for(AllReduceConfig.from_label(label), (256, 1024), 4)


def test_kernels_ask_for_a_shard_map_without_the_varying_axes_check():
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from equarx import all_reduce

    cfg = AllReduceConfig.from_label("int8@pallas")
    for dims, axes in (((2,), ("tp",)), ((2, 2), ("x", "y"))):
        mesh = Mesh(np.array(jax.devices()[:int(np.prod(dims))]).reshape(dims), axes)
        f = jax.shard_map(lambda v: all_reduce(v, axes, cfg), mesh=mesh, in_specs=P(axes),
                          out_specs=P(axes), check_vma=True)
        with pytest.raises(ValueError, match="check_vma=False"):
            jax.jit(f).trace(jax.ShapeDtypeStruct((len(mesh.devices.flat) * 64, 640),
                                                  "float32"))


def test_vmem_stays_bounded_for_every_model_message():
    """The window keeps the kernel's VMEM scratch under the smallest default scoped limit
    (16 MiB, v5e) for every message a model sends, up to 32k-token prefills."""
    from equarx import pallas_ring, pallas_torus

    worst = 0
    for label in check.CODEC_LABELS:
        for d in check.MODEL_D.values():
            for tp in check.TPS:
                for tokens in (1, 16, 2048, 8192, 32768):
                    p = pallas_ring.plan_for(AllReduceConfig.from_label(label), (tokens, d), tp)
                    r, lanes = p.piece  # whole native tiles: int8 32x128, bf16 16x128
                    rows = 16 if label.startswith("bf16") else 32
                    assert r % rows == 0 and lanes % 128 == 0, (label, d, tp, tokens, p.piece)
                    worst = max(worst, pallas_ring.vmem_bytes(p, "float32", "float32"))
                for dims in ((2, 2), (2, 4), (4, 4), (4, 8), (2, 2, 2), (2, 2, 4), (4, 4, 4)):
                    for tokens in (1, 2048, 32768):
                        p = pallas_torus.plan_for(AllReduceConfig.from_label(label), (tokens, d),
                                                  dims)
                        worst = max(worst, pallas_torus.vmem_bytes(p, dims, "float32"))
    assert worst < 16 << 20, worst


# One interpreted case per schedule shape, not the same shape at several sizes: interpret mode
# costs seconds per hop and device. The 1-D ring on 2 devices (the kernel's degenerate ring:
# both neighbours are one device, and no hop forwards) and on 4 (every branch of the schedule:
# reduce-scatter hops, the own shard's last partial, all-gather forwards, the last decode); a
# ring of 8 runs the same code for more hops (its cases ran here until the cut; `python
# tests/equarx/pallas_sweep.py` keeps them). Each codec in each dtype and each DMA mode across the two
# rings; messages with padded rows and columns, 3-D; on 2 devices also two windows of
# minishards (the last one short) and the public equarx.all_reduce dispatch. The multi-axis
# schedule once on each torus shape: 2x2 (equal axes), 2x4 (a shorter and a longer ring in
# one kernel) and 2x2x2 (three parts, each visiting the axes in a rotated order); int8 on the
# first and last with the race detector, bf16_ring through the public dispatch on 2x4 (every
# codec on every mesh in `python tests/equarx/pallas_sweep.py`); and a small model's logits with the
# default int8 through the kernels on 2x2, against the model with the reference plugged in.
INTERPRET_CASES = {
    2: [check.interpret_case("int8-full+tile@pallas", (64, 512), "bfloat16", "on_wait"),
        check.interpret_case("int8@pallas", (2, 50, 300), "float32", "eager"),
        check.interpret_case("bf16_ring@pallas", (1152, 128), "float32", "on_wait",
                             minishards=12),  # 5 minishards a direction: windows of 4 and 1
        check.interpret_case("int8@pallas", (64, 640), "bfloat16", public=True)],
    4: [check.interpret_case("int8-full+tile@pallas", (40, 1000), "float32", "eager"),
        check.interpret_case("int8@pallas", (2, 40, 520), "bfloat16", "on_wait"),
        check.interpret_case("bf16_ring@pallas", (200, 640), "bfloat16", "eager"),
        check.interpret_case("int8@pallas", (64, 640), "bfloat16", "eager", mesh="2x2"),
        check.model_case("int8@pallas", mesh="2x2")],
    8: [check.interpret_case("int8@pallas", (2, 40, 520), "float32", mesh="2x2x2"),
        check.interpret_case("bf16_ring@pallas", (2, 40, 520), "bfloat16", mesh="2x4",
                             public=True)],
}


@pytest.mark.parametrize("n_devices", sorted(INTERPRET_CASES))
def test_kernel_is_its_schedule_bitwise_in_interpret_mode(n_devices):
    rows = check.run_child(n_devices, INTERPRET_CASES[n_devices], timeout=600)
    assert check.failures(rows) == []
    cases = [r for r in rows if r["kind"] == "interpret"]
    models = [r for r in rows if r["kind"] == "model"]  # a model's programs with the kernels
    assert len(cases) + len(models) == len(INTERPRET_CASES[n_devices])
    assert all(r["bitwise"] and 0 < r["rel_error"] < 0.05 for r in models)
    # The ring cases exercise what they are meant to: pipelined minishards, and two windows.
    rings = [r for r in cases if not r["mesh"]]
    assert not rings or max(r["minishards_per_direction"] for r in rings) >= 2
    if n_devices == 2:
        assert any(r["minishards_per_direction"] > r["window"] for r in rings)
    for r in cases:  # a real AllReduce, not only an agreement between two paths
        assert r["rel_error"] < 0.05, r


def test_kernel_lowers_for_tpu_for_model_messages():
    """Every codec x tp x dtype, each with a model's d_model (all five appear) and a prefill
    chunk or bucket; every codec, in both dtypes, on a torus of two axes of different sizes
    (2x4) and on one of three (2x2x4, with two equal axes): between them what the 2x2 and 4x4
    tori have (k parts in rotated axis orders, rings of 2 and of 4 in one kernel), and each
    torus lowering costs 0.5-2 s. tests/equarx/pallas_sweep.py lowers the whole product, every mesh, with
    decode to 8k tokens."""
    models = list(check.MODEL_D.values())
    cases = []
    for i, (label, tp, dtype) in enumerate(
            (label, tp, dtype) for label in check.CODEC_LABELS for tp in check.TPS
            for dtype in check.DTYPES):
        cases.append(check.lower_case(label, tp, (16, 2048)[i % 2], models[i % len(models)],
                                      dtype))
    for i, (label, mesh) in enumerate((label, mesh) for label in check.CODEC_LABELS
                                      for mesh in ("2x4", "2x2x4")):
        j = (i + i // 2) % 2  # each codec and each mesh in both dtypes
        cases.append(check.lower_case(label, check.mesh_size(mesh), (16, 2048)[j],
                                      models[i % len(models)], check.DTYPES[j], mesh))
    rows = check.run_child(max(check.TPS), cases, timeout=600)
    assert check.failures(rows) == []
    assert all(r["lowered"] for r in rows) and len(rows) == len(cases)
