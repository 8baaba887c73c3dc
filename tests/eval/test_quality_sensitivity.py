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


def test_run_variance_means_and_group_stats():
    import jax.numpy as jnp
    import numpy as np

    # Row 0: runs of mean square 1 and 4 (AM 2.5, GM 2); row 1: one run all zero, floored at
    # 1e-6 of the row's mean; row 2: all zero (no runs to allocate: AM 0, GM 0).
    rows = np.zeros((3, 8), np.float32)
    rows[0, :4], rows[0, 4:] = 1.0, -2.0
    rows[1, :4] = 3.0
    am, gm = qs.run_variance_means(jnp.asarray(rows), 4)
    np.testing.assert_allclose(am, [2.5, 4.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(gm, [2.0, math.sqrt(9.0 * 4.5e-6), 0.0], rtol=1e-5)
    with pytest.raises(ValueError, match="runs of 3"):
        qs.run_variance_means(jnp.asarray(rows), 3)

    stats = qs.GroupStats()
    assert stats.report(2) is None
    stats.add(2.5, 2.0, 3.0, 2.0)
    stats.add(2.5, 2.0, 3.0, 2.0)
    assert stats.report(2) == {"reductions": 1, "run_var_am_over_gm": 1.25,
                               "ideal_allocation_rms_gain": math.sqrt(1.25),
                               "partials_energy_over_sum": 1.5}


def test_group_stats_measure_the_references_own_reductions():
    report = qs.run("random:tiny", 2, [], [1e-2], n_tokens=63, window=64, dtype="float32",
                    log=lambda *a: None, group_stats=True)
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["noise:0"]["kl_to_f32"] == 0  # added: the stats come from the reference itself
    gs = report["group_stats"]
    assert gs["reductions"] > 0 and gs["run_var_am_over_gm"] > 1.0
    # Two partials of a real layer's output are not one the negative of the other.
    assert 0.2 < gs["partials_energy_over_sum"] < 5
