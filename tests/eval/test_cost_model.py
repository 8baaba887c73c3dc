"""Cost model: alpha-beta arithmetic on known inputs, the fit recovering known parameters, the
byte schedule agreeing with the bytes equarx's compiled programs send, TPU predictions' shape."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from equarx import all_reduce, bytes_sent_per_device, collectives
from equarx.ring import ring_hops
from eval import cost_model as cm
from eval.bench_collective import parse_method
from models.gemma3 import get_config


def test_link_time_is_alpha_times_messages_plus_bytes_over_rate():
    s = cm.Schedule(messages=6, steps=4, bytes_per_device=1e6)
    link = cm.LinkModel(alpha_s=1e-4, rate_bytes_s=1e8, efficiency=0.5)
    assert link.comm_time(s, 4) == pytest.approx(6e-4 + 1e6 / 5e7)
    # A shared medium carries every device's bytes; per_step charges alpha per sequential step.
    shared = cm.LinkModel(1e-4, 1e8, 0.5, shared=True, per_step=True)
    assert shared.comm_time(s, 4) == pytest.approx(4e-4 + 4e6 / 5e7)
    # The psum penalty applies to XLA's psum only.
    psum = cm.Schedule(6, 6, 1e6, xla_psum=True)
    assert cm.LinkModel(0.0, 1e8, psum_penalty=2.0).comm_time(psum, 4) == pytest.approx(0.02)
    assert cm.LinkModel(0.0, 1e8, psum_penalty=2.0).comm_time(s, 4) == pytest.approx(0.01)


def test_schedules_of_the_methods():
    n_el, n = 4 * 8 * 128 * 1024, 4  # 4 shards x 1024 tiles: 4 minishards of 256 tiles each
    bf16 = cm.allreduce_schedule("bf16", n_el, n)
    assert bf16.xla_psum and bf16.messages == 6 and bf16.bytes_per_device == 1.5 * n_el * 2
    ring = cm.allreduce_schedule("bf16_ring-full", n_el, n)
    assert ring.bytes_per_device == pytest.approx(1.5 * n_el * 2) and ring.steps == 6
    full = cm.allreduce_schedule("int8-full+tile", n_el, n)
    # int8 payload plus one 4 KiB float32 scale tile per 256-tile minishard, per hop.
    assert full.bytes_per_device == pytest.approx(1.5 * n_el * (1 + 4 / 256))
    semi = cm.allreduce_schedule("int8-semi+tile", n_el, n)
    assert semi.bytes_per_device == full.bytes_per_device and semi.steps == 4  # 2 hops a phase
    rs = cm.allreduce_schedule("int8-full-rs+tile", n_el, n)
    assert rs.bytes_per_device == pytest.approx((full.bytes_per_device + ring.bytes_per_device) / 2)
    assert cm.allreduce_schedule("int8-full", n_el, 1) == cm.Schedule(0, 0, 0.0)
    assert ring_hops("full", 4) == (3, 3) and ring_hops("semi", 4) == (2, 3)
    assert ring_hops("semi", 5) == (2, 4)
    # The token layout's group codec: payload plus a scale byte per 32 values (and an exponent
    # byte per row of a piece: one row here); two-shot sends the ring's bytes in 2 steps (auto
    # on this machine: switched).
    group = cm.allreduce_schedule("int8", n_el, n)
    assert group.bytes_per_device == pytest.approx(1.5 * n_el * (1 + 1 / 32), rel=1e-5)
    assert group.steps == 2
    int4 = cm.allreduce_schedule("int4-full", n_el, n)
    assert int4.bytes_per_device == pytest.approx(1.5 * n_el * (0.5 + 1 / 32), rel=1e-5)
    assert int4.steps == 6
    for bad in ("int2", "int8-diagonal", "int8-full-both-x"):
        with pytest.raises(ValueError):
            cm.allreduce_schedule(bad, n_el, n)


@pytest.mark.parametrize("n", [2, 4])
def test_schedule_bytes_match_the_compiled_program(n):
    """Same bytes (and one collective-permute per message) as equarx's real compiled rings."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    n_el = 300_000
    x = jax.ShapeDtypeStruct((n * n_el,), jnp.bfloat16)
    for label, pipelined in (("bf16_ring", True), ("int8-full+tile", True),
                             ("int8-semi-ag+tile", True), ("int8-semi+tile", False),
                             ("int8-full+hadamard", True), ("int8", True), ("int8-full", False),
                             ("int4-semi", True), ("bf16_ring-full", False)):
        cfg = parse_method(label, 4, pipelined)
        f = jax.jit(jax.shard_map(lambda a, c=cfg: all_reduce(a, "tp", c), mesh=mesh,
                                  in_specs=P("tp"), out_specs=P("tp")))
        compiled = f.lower(x).compile()
        s = cm.allreduce_schedule(label, n_el, n, minishards=4, pipelined=pipelined)
        assert bytes_sent_per_device(compiled) == pytest.approx(s.bytes_per_device), label
        assert len(collectives(compiled)) == s.messages, label


def test_fit_recovers_known_link_parameters():
    truth = cm.LinkModel(alpha_s=3e-4, rate_bytes_s=0, efficiency=0.8, psum_penalty=2.5,
                         shared=True)
    samples = []
    for gbit in (0.5, 1.0, 2.0):
        link = cm.LinkModel(truth.alpha_s, cm.gbit_to_bytes_s(gbit), truth.efficiency,
                            truth.psum_penalty, shared=True)
        for label in ("bf16", "bf16_ring", "int8-full"):
            for n_el in (1 << 16, 1 << 20, 1 << 22):
                s = cm.allreduce_schedule(label, n_el, 4)
                samples.append(cm.CommSample(label, n_el, 4, gbit, link.comm_time(s, 4)))
    fit = cm.fit_link(samples)
    assert fit.alpha_s == pytest.approx(3e-4, rel=1e-6)
    assert fit.efficiency == pytest.approx(0.8, rel=1e-6)
    assert fit.psum_penalty == pytest.approx(2.5, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.max_rel_error < 1e-6
    with pytest.raises(ValueError):
        cm.fit_link(samples[:2])


def test_prefill_prediction_adds_two_allreduces_per_layer():
    link = cm.LinkModel(alpha_s=1e-3, rate_bytes_s=1e9)
    s = cm.allreduce_schedule("int8-full", 512 * 1152, 2)
    t = cm.predict_prefill_s(0.5, "int8-full", tokens=512, d_model=1152, num_layers=4,
                             n_devices=2, link=link)
    embed = link.comm_time(cm.allreduce_schedule("bf16", 512 * 1152, 2), 2)  # the lookup's psum
    assert t == pytest.approx(0.5 + 8 * link.comm_time(s, 2) + embed)
    assert cm.predict_prefill_s(0.5, "int8-full", tokens=512, d_model=1152, num_layers=4,
                                n_devices=2, link=link, embed_psum=False) == pytest.approx(
        0.5 + 8 * link.comm_time(s, 2))
    # A prompt run as steps: each step's AllReduces carry its own tokens; the first step samples
    # nothing, and its last layer's two AllReduces are dropped with the work they feed.
    assert cm.predict_prefill_s(0.5, "int8-full", tokens=[512, 512], d_model=1152, num_layers=4,
                                n_devices=2, link=link) == pytest.approx(
        0.5 + 2 * (t - 0.5) - 2 * link.comm_time(s, 2))
    fit = cm.Fit(0.0, 1.0, 1.0, 1.0, 3, 0.0)  # no latency: bytes alone decide
    rows = [{"length": 512, "step_tokens": [256, 256], "tp": 2, "method": m, "median_ms": 0.0}
            for m in ("bf16", "int8-full")]
    out = cm.predict_rows(rows, {(512, "bf16"): 500.0, (512, "int8-full"): 500.0}, fit,
                          8.0, d_model=1152, num_layers=4)
    assert out[0]["predicted_speedup_vs_bf16"] == pytest.approx(1.0)
    assert out[1]["predicted_speedup_vs_bf16"] > 1.0  # same compute, fewer bytes


def test_flops_and_tpu_predictions():
    cfg = get_config("27b")
    per_token = cm.prefill_flops(cfg, 1) - 2 * cfg.d_model * cfg.vocab_size
    matmul_params = 27_009_002_240 - cfg.vocab_size * cfg.d_model  # the 27B's parameters
    assert per_token == pytest.approx(2 * matmul_params, rel=1e-3)  # norms are not matmuls
    rows = cm.tpu_predictions()
    assert {(r["model"], r["tp"], r["tokens"]) for r in rows} >= {
        ("gemma3-27b", 16, 2048), ("gemma3-27b", 16, 8192), ("gemma3-12b", 4, 2048)}
    for r in rows:
        assert 1.0 < r["predicted_speedup"] < 2.0 and math.isfinite(r["bf16_ms"])
        assert r["predicted_speedup_quant_exposed"] <= r["predicted_speedup"]
    text = cm.format_tpu_predictions(rows)
    assert "PREDICTIONS" in text and "paper" in text


def test_cli_prints_the_tpu_predictions_and_asks_for_a_table(capsys):
    from eval.cost_model.__main__ import main

    main(["--tpu"])
    assert capsys.readouterr().out.strip() == cm.format_tpu_predictions(cm.tpu_predictions()).strip()
    with pytest.raises(SystemExit):
        main([])


# ---------------------------------------------------------------------------------------------
# Topologies


def _topo(dims, wrap=True, rate=1e9, alpha=0.0):
    return cm.Topology("t", tuple(dims), wrap, rate, alpha)


def test_routes_follow_the_grid():
    t = _topo((4, 4), wrap=True)
    assert t.route(0, 3) == [(0, 3)]  # wraparound: one hop the short way
    assert len(t.route(0, 10)) == 4  # (0,0) -> (2,2): two hops per axis
    line = _topo((4, 4), wrap=False)
    assert line.route(0, 3) == [(0, 1), (1, 2), (2, 3)]  # no wraparound: along the line
    order = cm.ring_order(line)  # a Hamiltonian cycle of the 4x4 mesh: every hop one link
    assert sorted(order) == list(range(16))
    assert all(len(line.route(a, b)) == 1 for a, b in zip(order, order[1:] + order[:1]))
    cube = _topo((4, 4, 4))
    order = cm.ring_order(cube)
    assert all(len(cube.route(a, b)) == 1 for a, b in zip(order, order[1:] + order[:1]))


def test_multi_axis_on_one_axis_is_the_bidirectional_ring():
    for n in (2, 4, 8):
        t = _topo((n,), alpha=1e-6)
        ring = cm.ring_steps(t, list(range(n)), 1 << 20, 2.0)
        assert cm.multi_axis_steps(t, 1 << 20, 2.0) == ring
        assert cm.steps_time_s(t, ring) == pytest.approx(
            2 * (n - 1) * (1e-6 + (1 << 21) / n / (2 if n > 2 else 1) / 1e9))


def test_more_links_take_less_time():
    n_el = 1 << 22
    ring16 = _topo((16,))
    grid = _topo((4, 4))
    # The same bytes over a 4x4 torus' 4 links a chip beat one ring's 2; one direction is slower
    # than two; a mesh (no wraparound) is slower than the torus.
    multi = cm.topology_allreduce_s(grid, "int8-multi-axis", n_el)
    assert multi < cm.topology_allreduce_s(ring16, "int8-multi-axis", n_el)
    assert multi < cm.topology_allreduce_s(grid, "int8-1d-bidi", n_el)
    assert (cm.topology_allreduce_s(grid, "int8-1d-bidi", n_el)
            < cm.topology_allreduce_s(grid, "int8-1d-uni", n_el))
    assert multi < cm.topology_allreduce_s(_topo((4, 4), wrap=False), "int8-multi-axis", n_el)
    # On the torus the multi-axis schedule uses all 4 links, the ring 2: half the link time.
    link = cm.steps_time_s(grid, cm.multi_axis_steps(grid, n_el, 1.0))
    assert link == pytest.approx(cm.steps_time_s(grid, cm.ring_steps(
        grid, cm.ring_order(grid), n_el, 1.0)) / 2, rel=0.07)
    # int8 sends about half of bf16's bytes.
    assert cm.topology_allreduce_s(grid, "int8-multi-axis", n_el) == pytest.approx(
        cm.topology_allreduce_s(grid, "xla-bf16", n_el) * cm.INT8_WIRE_BYTES / 2)


def test_predictions_are_monotone_in_bandwidth():
    cfg = get_config("27b")
    last = None
    for rate in (25e9, 50e9, 100e9, 200e9):
        topo = cm.Topology("t", (4, 4), False, rate, 2e-6, cm.TPU_V5E)
        times = {m: cm.predict_topology(cfg, topo, 2048, m)["total_ms"]
                 for m in cm.TOPOLOGY_METHODS}
        if last:
            assert all(times[m] < last[m] for m in times)
            # a faster link leaves less for int8 to save
            assert (times["xla-bf16"] / times["int8-multi-axis"]
                    < last["xla-bf16"] / last["int8-multi-axis"])
        last = times


def test_topology_table():
    rows = cm.topology_predictions(tokens=(2048,))
    by = {(r["model"], r["topology"]): r for r in rows}
    r = by["gemma3-27b", "v5e-4x4"]
    assert r["tp"] == 16 and r["paper_speedup"] == 1.28
    assert r["int8-multi-axis"]["speedup"] > r["int8-1d-bidi"]["speedup"] > 1.0
    assert r["xla-bf16"]["speedup"] == pytest.approx(1.0)
    assert all(r[m]["speedup_quant_exposed"] <= r[m]["speedup"] for m in cm.TOPOLOGY_METHODS)
    assert "PREDICTIONS" in cm.format_topology_predictions(rows)


def test_program_transfers_reads_the_compiled_permutes():
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    cfg = parse_method("bf16_ring-full", 4, False)
    f = jax.jit(jax.shard_map(lambda a: all_reduce(a, "tp", cfg), mesh=mesh,
                              in_specs=P("tp"), out_specs=P("tp")))
    prog = f.lower(jax.ShapeDtypeStruct((4 * 8192,), jnp.bfloat16)).compile()
    steps = cm.program_transfers(prog, [0, 1, 3, 2])  # a snake of the 2x2 torus
    assert len(steps) == len(collectives(prog))
    assert sum(b for s in steps for _, _, b in s) / 4 == pytest.approx(
        bytes_sent_per_device(prog))
    t = _topo((2, 2))
    assert all(len(t.route(a, b)) == 1 for s in steps for a, b, _ in s)  # neighbours only


def test_emulated_prediction_adds_the_links_to_the_base_run():
    run = {"torus": [2, 2], "link_gbit": 1.0, "rows": [
        {"size_bytes": 1 << 20, "method": "int8:torus", "median": 0.05},
        {"size_bytes": 1 << 20, "method": "bf16:torus", "median": 0.09}]}
    base = {"torus": [2, 2], "link_gbit": None, "processes": 4,
            "rows": [{"size_bytes": 1 << 20, "method": "int8:torus", "median": 0.01}]}
    terms = {(1 << 20, "int8:torus"): {"steps": 4, "link_bytes": [1e6, 1e6, 5e5, 5e5]}}
    rows = cm.predict_emulated(run, base, terms, alpha_s=1e-3)
    predicted = 0.01 + 3e6 / cm.gbit_to_bytes_s(1.0) + 4e-3
    assert rows[0]["predicted_s"] == pytest.approx(predicted)
    assert rows[0]["error"] == pytest.approx(predicted / 0.05 - 1)
    assert "predicted_s" not in rows[1]  # XLA's psum: gloo's algorithm, not modelled
    assert cm.base_kind(base, run) == "unshaped torus"
    assert cm.base_kind({"processes": 0, "torus": None}, run) == "one process"
    for wrong in ({"torus": [2, 2], "link_gbit": 1.0}, {"torus": [4], "link_gbit": None},
                  {"torus": None, "processes": 4}):
        with pytest.raises(ValueError):
            cm.base_kind(wrong, run)
