"""`gemma3-generate` end to end on a tiny random model (in this process, on 2 of the session's
virtual devices): the label-spelled AllReduce reaches the model and the prompt is generated."""
import pytest

from serving.cli import generate_main


def test_generate_streams_a_continuation(capsys):
    with pytest.raises(SystemExit) as e:
        generate_main(["The capital of France is", "--model", "random:tiny", "--tp", "2",
                       "--allreduce", "int8-semi+hadamard", "--max-tokens", "4",
                       "--compile-cache-dir", ""])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    assert "allreduce=int8-semi+hadamard" in err
    assert "[4 tokens in" in err and "finish: length" in err


def test_generate_refuses_a_bad_label_before_loading(capsys):
    with pytest.raises(SystemExit) as e:
        generate_main(["hello", "--allreduce", "int8-diagonal"])
    assert e.value.code == 2 and "AllReduce label" in capsys.readouterr().err
