"""Tensor-parallel layout, declared once: logical axes -> the mesh axis "tp".

A multi-axis TP mesh (`--tp-mesh 2x2`) realizes "tp" as the tuple of its axes, in row-major order,
so every device holds the shard it holds on a 1-D mesh. Query heads, FFN, vocabulary and KV heads
(when tp divides them) are split; with fewer KV heads than devices the KV projection is replicated.
See docs/algorithm.md, "Where the model calls it"."""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.gemma3.config import Gemma3Config
from models.gemma3.weights import Weights, map_weights

AXIS = "tp"
# Names of a multi-axis TP mesh's axes, in order (a TPU torus' x, y, z).
MESH_AXES = ("x", "y", "z")

# Logical axes of each tensor's dims.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "d_model"),
    "final_norm": ("d_model",),
    "q": ("d_model", "heads", "head_dim"),
    "kv": ("d_model", None, "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "d_model"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "pre_attn_norm": ("d_model",),
    "post_attn_norm": ("d_model",),
    "pre_ffw_norm": ("d_model",),
    "post_ffw_norm": ("d_model",),
    "gating": ("d_model", None, "ffn"),
    "linear": ("ffn", "d_model"),
}


def check_tp(c: Gemma3Config, tp: int) -> None:
    """Raise a clear error when `c` cannot be split `tp` ways."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    for what, n in (("num_heads", c.num_heads), ("ffn_hidden", c.ffn_hidden),
                    ("vocab_size", c.vocab_size)):
        if n % tp:
            raise ValueError(f"tp={tp} must divide {what}={n} of {c.name}")
    if c.num_kv_heads % tp and tp % c.num_kv_heads:
        raise ValueError(f"tp={tp} must divide num_kv_heads={c.num_kv_heads} of {c.name}, or be "
                         "a multiple of it (KV heads are then replicated)")


def kv_sharded(c: Gemma3Config, tp: int) -> bool:
    return c.num_kv_heads % tp == 0


def local_kv_heads(c: Gemma3Config, tp: int) -> int:
    """KV heads each device computes and caches."""
    return c.num_kv_heads // tp if kv_sharded(c, tp) else 1


def rules(c: Gemma3Config, tp: int) -> dict[str, str | None]:
    return {"vocab": AXIS, "heads": AXIS, "ffn": AXIS, "cache_heads": AXIS,
            "kv_heads": AXIS if kv_sharded(c, tp) else None}


def _spec(logical: tuple[str | None, ...], table: dict) -> P:
    return P(*(table.get(a) if a else None for a in logical))


def weight_specs(c: Gemma3Config, tp: int) -> Weights:
    """PartitionSpec of every weight, in a Weights tree."""
    table = rules(c, tp)
    return map_weights(c, lambda layer, name, shape: _spec(PARAM_AXES[name], table))


def parse_tp_mesh(tp_mesh, tp: int) -> tuple[int, ...] | None:
    """The TP mesh shape `tp_mesh` names for `tp` devices: None or "" (1-D), "auto" (returned
    as None here: `mesh_shape` resolves it from the devices), "AxB[xC]" or a sequence of ints.
    Axes of size 1 are dropped (a single axis left is the 1-D mesh); ValueError, naming the
    setting, when the text does not parse or the product of the axes is not tp."""
    if tp_mesh is None or (isinstance(tp_mesh, str) and tp_mesh.strip().lower() in ("", "auto")):
        return None
    if isinstance(tp_mesh, str):
        parts = tp_mesh.strip().lower().split("x")
        try:
            shape = tuple(int(p) for p in parts)
        except ValueError:
            shape = ()
        if not shape or any(not p.strip().isdigit() for p in parts):
            raise ValueError(f"tp_mesh must be axis sizes joined by 'x' (e.g. 2x2 or 2x2x2) or "
                             f"'auto', got {tp_mesh!r}")
    else:
        shape = tuple(int(n) for n in tp_mesh)
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"tp_mesh axes must be >= 1, got {tp_mesh!r}")
    if math.prod(shape) != tp:
        raise ValueError(f"tp_mesh {'x'.join(map(str, shape))} has {math.prod(shape)} devices "
                         f"but tp={tp}: the product of its axes must equal tp")
    shape = tuple(n for n in shape if n > 1)
    if len(shape) > len(MESH_AXES):
        raise ValueError(f"tp_mesh may have at most {len(MESH_AXES)} axes larger than 1 "
                         f"({', '.join(MESH_AXES)}), got {tp_mesh!r}")
    return shape if len(shape) > 1 else None


def _topology_mesh(devices: Sequence) -> tuple[list, tuple[int, ...]] | None:
    """(devices in row-major order, shape) of the devices' physical grid when every device
    reports TPU-style `coords` and they fill a box of one device per coordinate; else None."""
    coords = [getattr(d, "coords", None) for d in devices]
    if any(c is None for c in coords) or len(set(map(tuple, coords))) != len(devices):
        return None
    dims = [i for i in range(len(coords[0])) if len({c[i] for c in coords}) > 1]
    extents = [len({c[i] for c in coords}) for i in dims]
    if math.prod(extents) != len(devices):
        return None
    order = sorted(range(len(devices)), key=lambda j: tuple(coords[j][i] for i in dims))
    return [devices[j] for j in order], tuple(extents)


def make_mesh(tp: int, devices=None, tp_mesh=None) -> Mesh:
    """The tensor-parallel mesh over `tp` devices, with a clear error when there are not enough
    of them: 1-D (axis "tp") by default; with `tp_mesh` ("2x2", (2, 2), see `parse_tp_mesh`)
    axes ("x", "y"[, "z"]) of those sizes, the devices in row-major order. "auto" takes the
    shape from the devices' physical coordinates (a TPU slice's torus) when they report them,
    and is 1-D otherwise (CPU, GPU)."""
    shape = parse_tp_mesh(tp_mesh, tp)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp:
        platform = devices[0].platform if devices else "?"
        hint = (" On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is "
                "imported to get N devices." if platform == "cpu" else "")
        raise ValueError(f"tp={tp} needs {tp} devices, only {len(devices)} {platform} device(s) "
                         f"are available.{hint}")
    devices = devices[:tp]
    if isinstance(tp_mesh, str) and tp_mesh.strip().lower() == "auto":
        found = _topology_mesh(devices)
        if found is not None and len(found[1]) > 1:
            devices, shape = found
    if shape is None:
        return Mesh(np.array(devices), (AXIS,))
    return Mesh(np.array(devices).reshape(shape), MESH_AXES[:len(shape)])


def tp_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """What the logical axis "tp" is on `mesh`: its one axis' name, or the tuple of its axes."""
    names = tuple(mesh.axis_names)
    return names[0] if len(names) == 1 else names


def mesh_label(mesh: Mesh) -> str | None:
    """"2x2" for a multi-axis TP mesh, None for a 1-D one."""
    names = tuple(mesh.axis_names)
    return None if len(names) == 1 else "x".join(str(mesh.shape[a]) for a in names)


def resolve(spec: P, mesh: Mesh) -> P:
    """`spec` with the logical "tp" replaced by `mesh`'s tp_axes."""
    axes = tp_axes(mesh)
    if axes == AXIS:
        return spec
    return P(*(axes if entry == AXIS else entry for entry in spec))


def named(mesh: Mesh, specs):
    """NamedSharding tree for a tree of PartitionSpecs (the logical "tp" resolved on `mesh`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, resolve(s, mesh)), specs,
                        is_leaf=lambda x: isinstance(x, P))


def resolve_tree(mesh: Mesh, specs):
    """A tree of PartitionSpecs with the logical "tp" resolved on `mesh` (for shard_map)."""
    return jax.tree.map(lambda s: resolve(s, mesh), specs, is_leaf=lambda x: isinstance(x, P))
