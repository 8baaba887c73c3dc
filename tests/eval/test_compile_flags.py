"""eval.compile_flags: a setting's measurement in its own process, and a flag XLA does not know
reported instead of crashing the comparison."""
from eval import compile_flags

MODEL = "random:tiny?layers=1"


def test_a_setting_is_measured_in_a_fresh_process():
    row = compile_flags.measure("", MODEL)
    assert "error" not in row, row
    assert row["programs"] > 0 and row["compile_s"] > 0 and row["cpu_s"] > 0
    assert len(row["bits"]) == 16 and int(row["bits"], 16) >= 0


def test_an_unknown_flag_is_reported():
    row = compile_flags.measure("--xla_cpu_no_such_flag=true", MODEL)
    assert "Unknown flag" in row["error"] and "--xla_cpu_no_such_flag" in row["error"]
