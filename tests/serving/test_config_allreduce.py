"""The AllReduce setting has one spelling, `equarx.AllReduceConfig.label`, in flags, environment
and config files; the old per-field settings are aliases that rewrite that label."""
import argparse

import pytest

import equarx.config
from equarx import AllReduceConfig
from serving.config import ServerConfig, add_arguments, allreduce_labels, from_sources


def test_the_labels_are_equarxs():
    labels = allreduce_labels()
    assert len(labels) == len(set(labels))
    for label in labels:
        assert AllReduceConfig.from_label(label).label == label
    assert {"f32", "bf16", "bf16_ring", "int8-semi-rs+hadamard"} <= set(labels)
    assert {AllReduceConfig.from_label(x).method for x in labels} == set(equarx.config.METHODS)


def test_one_label_from_every_source(tmp_path):
    assert from_sources({}, env={}).allreduce_config() == AllReduceConfig("bf16")
    cfg = from_sources({"allreduce": "int8-semi+hadamard"}, env={}).allreduce_config()
    assert (cfg.method, cfg.variant, cfg.blocks) == ("int8", "semi", "hadamard")
    cfg = from_sources({}, env={"GEMMA3_ALLREDUCE": "int8-full-ag", "GEMMA3_ALLREDUCE_MINISHARDS": "8"}
                       ).allreduce_config()
    assert (cfg.label, cfg.minishards) == ("int8-full-ag", 8)
    f = tmp_path / "c.toml"
    f.write_text('allreduce = "int8-semi-rs"\nallreduce_min_bytes = 1024\n')
    cfg = from_sources({"config": str(f)}, env={}).allreduce_config()
    assert (cfg.label, cfg.min_bytes) == ("int8-semi-rs", 1024)
    assert from_sources({"allreduce": "int8"}, env={}).allreduce_config() == AllReduceConfig.from_label("int8")


def test_bad_labels_name_the_choices():
    with pytest.raises(ValueError, match="int8-semi-rs\\+hadamard"):
        ServerConfig(allreduce="int3")
    with pytest.raises(ValueError, match="AllReduce label"):
        from_sources({}, env={"GEMMA3_ALLREDUCE": "int8-diagonal"})


def test_old_spellings_rewrite_the_label():
    parser = argparse.ArgumentParser()
    add_arguments(parser, only=("allreduce",))
    args = parser.parse_args(["--allreduce", "int8", "--allreduce-variant", "semi", "--allreduce-phases", "ag"])
    c = from_sources(vars(args), env={})
    assert c.allreduce == "int8-semi-ag" and not hasattr(c, "allreduce_variant")
    # As when they were settings of their own: each source sets its part.
    c = from_sources({"allreduce": "int8-semi"}, env={"GEMMA3_ALLREDUCE_BLOCKS": "hadamard"})
    assert c.allreduce == "int8-semi+hadamard"
    with pytest.raises(SystemExit):
        parser.parse_args(["--allreduce-blocks", "diagonal"])


def test_batch_invariance_needs_a_token_local_allreduce():
    # In deterministic mode (opt-in with the default paged engine), the AllReduce decides.
    det = dict(deterministic=True)
    assert ServerConfig(tp=2, allreduce="int8", **det).batch_invariant
    assert ServerConfig(tp=2, allreduce="bf16_ring", **det).batch_invariant
    # The paper's tile scales span several tokens: a request can depend on its neighbours.
    assert not ServerConfig(tp=2, allreduce="int8-full+tile", **det).batch_invariant
    assert not ServerConfig(tp=2, allreduce="int8+hadamard", **det).batch_invariant
    assert ServerConfig(tp=1, allreduce="int8-full+tile", **det).batch_invariant  # no AllReduce runs
    assert not ServerConfig(tp=2, allreduce="int8", deterministic=False).batch_invariant
