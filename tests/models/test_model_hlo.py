"""The compiled programs prove the tensor-parallel communication plan: every layer's two partial
sums go through `equarx.all_reduce`, the vocab-parallel embedding adds exactly one (exact)
all-reduce per forward pass, and XLA adds no other collective (nothing gathered, no logits
all-reduced, no activation reduction left to XLA)."""
import collections
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig, all_reduce
from models.gemma3 import StepShape, load_model
from models.gemma3.sharding import make_mesh

COLLECTIVES = ("all-reduce", "collective-permute", "all-gather", "all-to-all", "reduce-scatter",
               "collective-broadcast")
_OP = re.compile(r"= (\S.*?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo: str) -> dict[str, list[str]]:
    """Collective op kind -> result shapes, one entry per op in an HLO module's text."""
    found = collections.defaultdict(list)
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m:
            found[m.group(2)].append(m.group(1))
    return found


def elements(shape: str) -> int:
    dims = re.search(r"\[([\d,]*)\]", shape).group(1)
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def equarx_alone(tp: int, shape: tuple[int, ...], config: AllReduceConfig) -> dict[str, list]:
    """Collectives of one standalone equarx.all_reduce of an activation of `shape`."""
    mesh = make_mesh(tp)
    body = lambda x: all_reduce(x[0], "tp", config)[None]  # noqa: E731
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    return collectives(fn.lower(jnp.zeros((tp, *shape), jnp.bfloat16)).compile().as_text())


# tp=4 replicates the tiny model's 2 KV heads; tp=2 shards them.
CASES = [(4, "bf16"), (2, "int8")]


def _local_pages(queries: int, window: int = 8, page: int = 16) -> int:
    return -(-(window - 1 + queries) // page) + 1


@pytest.mark.parametrize("tp,method", CASES)
def test_two_equarx_all_reduces_per_layer_and_one_for_the_embedding(tp, method):
    config = AllReduceConfig(method=method)
    m = load_model("random:tiny", tp=tp, dtype="bfloat16", allreduce=config)
    layers, d = m.config.num_layers, m.config.d_model
    pages = m.pages_shapes(17, 17, 16)
    # (T, S, Q): a decode step of 8 rows, a lone prompt's piece of 32 tokens.
    for name, (t, s, q) in [("decode", (8, 8, 1)), ("prompt piece", (32, 1, 32))]:
        key = m.ragged_key(StepShape(t, s, q, 8, _local_pages(q)), pages)
        ops = collectives(m.lower_ragged(key).compile().as_text())
        act_shape = (1, t, d)
        per_call = equarx_alone(tp, act_shape, config)
        assert set(ops) <= {"all-reduce", "collective-permute"}, (name, dict(ops))
        # Every all-reduce carries one activation: 2 per layer from equarx (if its method uses
        # XLA's all-reduce at all) plus the embedding's.
        assert [elements(x) for x in ops["all-reduce"]] == [t * d] * len(ops["all-reduce"]), name
        assert len(ops["all-reduce"]) == 2 * layers * len(per_call["all-reduce"]) + 1, name
        assert len(ops["collective-permute"]) == 2 * layers * len(per_call["collective-permute"])
        if method == "int8":  # the ring: only the embedding's all-reduce is left to XLA
            assert len(ops["all-reduce"]) == 1 and per_call["collective-permute"]
