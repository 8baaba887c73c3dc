"""eval.quality_sensitivity: the noise variants err by the size asked for, the error is measured
against the exact sum as the reference delivers it, and KL follows the error in a float32 model."""
import math
import time

import pytest

from equarx import AllReduceConfig
from eval import quality_sensitivity as qs


def _rows(dtype, modes, noise):
    report = qs.run("random:tiny", 2, modes, noise, n_tokens=63, window=64, dtype=dtype,
                    log=lambda *a: None)
    assert report["tokens_scored"] == 63
    return {r["variant"]: r for r in report["rows"]}


def test_float32_model_noise_errs_as_asked_and_kl_grows_with_its_square():
    rows = _rows("float32", ["bf16_ring"], [1e-3, 1e-2])
    for eps in (1e-3, 1e-2):
        assert rows[f"noise:{eps:g}"]["allreduce_rel_error"] == pytest.approx(eps, rel=0.1)
    # No floor in a float32 model: KL ~ error^2 (x100 expected for x10 the noise).
    assert rows["noise:0.01"]["kl_to_f32"] > 30 * rows["noise:0.001"]["kl_to_f32"] > 0
    # bf16_ring rounds the partials to bfloat16: an error of about one bf16 rounding.
    assert 5e-4 < rows["bf16_ring"]["allreduce_rel_error"] < 5e-3
    assert "noise:0.01" in qs.format_table(list(rows.values()))


def test_bfloat16_model_error_is_against_the_delivered_sum():
    """In a bf16 model the two-shot bf16 ring delivers the exact sum rounded once, as the
    reference does: zero error and identical logits. Anything that compared with the unrounded
    sum (or let XLA drop the reference's rounding) would report about 2e-3 here."""
    rows = _rows("bfloat16", ["bf16_ring"], [0.0, 1e-2])
    for exact in ("bf16_ring", "noise:0"):  # noise:0 is the exact sum, rounded explicitly
        assert rows[exact]["allreduce_rel_error"] == 0 and rows[exact]["kl_to_f32"] == 0
    assert rows["noise:0.01"]["allreduce_rel_error"] == pytest.approx(1e-2, rel=0.2)
    assert rows["noise:0.01"]["kl_to_f32"] > 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="not both"):
        qs.measured_reduction(qs.ErrorMeter(), AllReduceConfig("int8"), 1e-3)
    with pytest.raises(ValueError, match="not both"):
        qs.measured_reduction(qs.ErrorMeter())
    for text in ("-1e-3", "nan", "1e-3,inf"):
        with pytest.raises(ValueError, match=">= 0"):
            qs.parse_noise(text)
    assert qs.parse_noise("0, 1e-3, 2e-3") == [0.0, 1e-3, 2e-3]
    assert qs.ErrorMeter().relative is None
    meter = qs.ErrorMeter()
    meter.add(1.0, 4.0)
    assert meter.relative == math.sqrt(0.25)


def test_error_meter_loses_nothing_to_concurrent_callbacks():
    """The devices' callbacks arrive on several threads at once, with device arrays whose
    conversion to a float releases the GIL; every addition must count."""
    import threading

    class DeviceValue:  # like a jax.Array: float() waits for the value with the GIL released
        def __init__(self, v):
            self.v = v

        def __float__(self):
            time.sleep(0)
            return self.v

    meter, n_threads, n_adds = qs.ErrorMeter(), 4, 2000
    threads = [threading.Thread(target=lambda: [meter.add(DeviceValue(1.0), DeviceValue(2.0))
                                                for _ in range(n_adds)])
               for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (meter.err2, meter.ref2) == (n_threads * n_adds, 2 * n_threads * n_adds)


def test_run_squares_allocation_gain_and_group_stats():
    import jax.numpy as jnp
    import numpy as np

    from equarx import groups

    rows = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    sq = np.asarray(qs.run_squares(jnp.asarray(rows), 32))
    r = np.square(np.asarray(groups.rotate(jnp.asarray(rows), 32))).reshape(3, 2, 32)
    np.testing.assert_allclose(sq, np.stack([r.mean(-1), r.max(-1)]), rtol=1e-6)
    # The rotation keeps a run's energy (times g: it is unnormalized).
    np.testing.assert_allclose(sq[0], 32 * np.square(rows).reshape(3, 2, 32).mean(-1), rtol=1e-5)
    with pytest.raises(ValueError, match="runs of 3"):
        qs.run_squares(jnp.asarray(rows), 3)

    # Equal runs: nothing to gain. Runs 16x apart in largest square: one bit moves (7 + 9
    # bits), a second would cost more than it saves.
    assert qs.allocation_gain(np.ones((4, 5))) == 1.0
    uniform = 17 / 127 ** 2
    moved = 1 / 63 ** 2 + 16 / 255 ** 2
    assert qs.allocation_gain(np.array([[1.0, 16.0]])) == pytest.approx(math.sqrt(uniform / moved))
    assert moved < 1 / 31 ** 2 + 16 / 511 ** 2
    assert qs.allocation_gain(np.zeros((2, 3))) == 1.0

    stats = qs.GroupStats()
    assert stats.report(2) is None
    squares = np.stack([np.array([[1.0, 4.0]]), np.array([[1.0, 16.0]])])  # [2, rows, runs]
    stats.add(squares, 3.0, 2.0, 0)
    stats.add(squares, 3.0, 2.0, 1)  # another device's copy of the same sum: not counted twice
    report = stats.report(1)
    assert report["reductions"] == 1 and report["runs_per_row"] == 2
    assert report["run_var_am_over_gm"] == pytest.approx(2.5 / 2.0)
    assert report["integer_allocation_rms_gain"] == pytest.approx(math.sqrt(uniform / moved))
    assert report["partials_energy_over_sum"] == 1.5
    assert report["run_peak_to_rms"] == pytest.approx(math.sqrt((1 + 4) / 2))
    assert 2.3 < report["gaussian_run_peak_to_rms"] < 2.5  # the largest of 32 normal values
    assert stats.report(2)["runs_per_piece"] == 1  # two pieces of one run: nothing to move
    assert stats.report(2)["integer_allocation_rms_gain"] == 1.0


def test_group_stats_measure_the_references_own_reductions():
    report = qs.run("random:tiny", 2, [], [1e-2], n_tokens=63, window=64, dtype="float32",
                    log=lambda *a: None, group_stats=True)
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["noise:0"]["kl_to_f32"] == 0  # added: the stats come from the reference itself
    gs = report["group_stats"]
    assert gs["reductions"] > 0 and gs["run_var_am_over_gm"] > 1.0
    assert gs["integer_allocation_rms_gain"] >= 1.0
    # Two partials of a real layer's output are not one the negative of the other.
    assert 0.2 < gs["partials_energy_over_sum"] < 5
