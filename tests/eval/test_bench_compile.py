"""eval.bench_compile: a configuration's first start and its restart, each in its own process,
the restart reading back what the first one stored."""
import pytest

from eval import bench_compile

MODEL = "random:tiny?layers=1"


def test_a_restart_reads_back_what_the_first_start_compiled():
    row = bench_compile.measure(MODEL, "2:int8", native=True)
    # The first start stores the step's programs; the restart reads them back and stores
    # nothing new.
    assert row["cold_cache_bytes"] > 0, row
    assert row["restart_cache_bytes"] == row["cold_cache_bytes"], row
    assert 1 <= row["allreduce_fusions"] < row["allreduce_instructions"], row


def test_a_configuration_is_spelled_tp_colon_label():
    assert bench_compile._parse("2x2:int8") == (4, "2x2", "int8")
    assert bench_compile._parse("4:bf16") == (4, None, "bf16")
    with pytest.raises(SystemExit, match="TP:LABEL"):
        bench_compile._parse("int8")
