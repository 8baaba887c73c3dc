"""equarx over JAX's distributed runtime: one process per device, gloo over TCP (eval.multiproc)."""
import os
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx import AllReduceConfig, all_reduce
from eval import multiproc

CONFIGS = [AllReduceConfig("bf16_ring"), AllReduceConfig("int8"), AllReduceConfig("int8", "full"),
           AllReduceConfig("int8", "semi")]
SHAPE = (3, 70_000)  # ragged: exercises padding; large enough for real (non-trivial) blocks


def _inputs(n: int) -> np.ndarray:
    return np.random.default_rng(42).standard_normal((n,) + SHAPE).astype(np.float32)


def _results_on(mesh: Mesh, x: jax.Array) -> list[list[int]]:
    out = []
    for cfg in CONFIGS:
        f = jax.jit(jax.shard_map(lambda a, c=cfg: all_reduce(a, "tp", c), mesh=mesh,
                                  in_specs=P("tp"), out_specs=P("tp")))
        y = f(x)
        # Each process reports the bits of its own replica (exact comparison across runs).
        local = np.asarray(y.addressable_shards[0].data, np.float32)
        out.append([int(v) for v in local.view(np.uint32).reshape(-1)[::97]])
    return out


def all_reduce_bits() -> list[list[int]]:
    """Entry run in every worker: all_reduce this process's row of the shared inputs."""
    n, me = jax.process_count(), jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    sharding = NamedSharding(mesh, P("tp"))
    x = jax.make_array_from_process_local_data(sharding, _inputs(n)[me], (n * SHAPE[0],) + SHAPE[1:])
    return _results_on(mesh, x)


def timed_transfer(nbytes: int) -> float:
    """Entry: median seconds of one ppermute of `nbytes` int8 around the ring."""
    n = jax.process_count()
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("tp")),
                                               np.ones(nbytes, np.int8), (n * nbytes,))
    f = jax.jit(jax.shard_map(
        lambda a: jax.lax.ppermute(a, "tp", [(i, (i + 1) % n) for i in range(n)]),
        mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    f(x).block_until_ready()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def test_processes_over_gloo_match_virtual_devices_bit_for_bit():
    n = 2
    per_process = multiproc.run(f"{__name__}:all_reduce_bits", n, timeout_s=300)
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    x = jnp.asarray(_inputs(n).reshape((n * SHAPE[0],) + SHAPE[1:]))
    local = _results_on(mesh, jax.device_put(x, NamedSharding(mesh, P("tp"))))
    # Replicas agree across processes, and with the single-process run of the same program.
    assert per_process[0] == per_process[1]
    assert per_process[0] == local


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"),
                    reason="a shaped loopback needs root, ip and tc")
def test_shaped_link_limits_the_rate_and_is_cleaned_up():
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    nbytes, gbit = 4_000_000, 1.0
    seconds = multiproc.run(f"{__name__}:timed_transfer", 2, args=(nbytes,), link_gbit=gbit,
                            timeout_s=300)
    # Both processes send nbytes at once through the one shaped loopback.
    floor = 2 * nbytes * 8 / (gbit * 1e9)
    assert min(seconds) >= 0.8 * floor, (seconds, floor)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before


def test_launcher_rejects_bad_requests_and_reports_failures():
    with pytest.raises(ValueError, match="module:function"):
        multiproc.run("no_colon", 2)
    with pytest.raises(ValueError):
        multiproc.run(f"{__name__}:timed_transfer", 0)
    with pytest.raises(RuntimeError, match="exited"):
        multiproc.run(f"{__name__}:does_not_exist", 1, timeout_s=120)
