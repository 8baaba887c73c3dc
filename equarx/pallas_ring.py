"""EQuARX's full-loop ring as one Pallas TPU kernel (AllReduceConfig(impl="pallas")): a
bidirectional ring's reduce-scatter and all-gather, minishards streamed from HBM through VMEM and
sent by remote DMA, both phases quantized.

Per minishard it is equarx.ring's schedule with equarx.codecs' arithmetic, so the ring functions are
its bitwise reference (`reference_all_reduce`). Off TPU it runs in interpret mode, which checks
correctness only. See docs/native_kernel.md."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from equarx import codecs, groups, ring
from equarx.config import AllReduceConfig
from equarx.layout import MIN_PIECE_ELEMENTS
from equarx.pallas_codecs import (MAX_PIECE_ELEMENTS, WINDOW, FloatCodec, GroupCodec,
                                  KernelCodec, KernelPlan, TileCodec, plan)

COLLECTIVE_ID = 0  # the barrier semaphore: every call of this kernel talks to the same neighbours
TRANSPORTS = 2  # payload and scales
VMEM_MARGIN = 4 << 20


def interpret_default():
    """Interpret mode unless running on a TPU."""
    return None if jax.devices()[0].platform == "tpu" else pltpu.InterpretParams()


def reference_chains(p: KernelPlan) -> list[ring.Chain]:
    """The ring's chains that run the kernel's schedule with the ppermute implementation."""
    n, mh = p.n_devices, p.minishards
    return [ring.Chain(+1, n - 1, tuple((j, j + 1) for j in range(mh))),
            ring.Chain(-1, n - 1, tuple((j, j + 1) for j in range(mh, 2 * mh)))]


def vmem_bytes(p: KernelPlan, in_dtype, out_dtype) -> int:
    """The kernel's VMEM scratch, in bytes: bounded by the window, whatever the message."""
    return vmem_per_part(p.codec, p.piece, p.window, in_dtype, out_dtype)


def vmem_per_part(codec: KernelCodec, piece: tuple[int, int], window: int, in_dtype,
                   out_dtype) -> int:
    """VMEM scratch of one part (two directions) of parts_kernel_call."""
    r, l = piece
    slots = window + 2
    wire = r * l * jnp.dtype(codec.wire_dtype).itemsize
    scales = 0 if codec.scale_shape is None else (
        codec.scale_shape[0] * codec.scale_shape[1] * jnp.dtype(codec.scale_dtype).itemsize)
    per_direction = (2 * r * l * (jnp.dtype(in_dtype).itemsize + jnp.dtype(out_dtype).itemsize)
                     + (2 + slots) * (wire + scales))
    return 2 * per_direction


def check_untyped(x: jax.Array) -> None:
    """The kernels run inside shard_map(..., check_vma=False) only: in this JAX, with the
    varying-axes check on, Mosaic's lowering of the remote DMAs' device ids and the TPU
    interpreter both fail deep inside JAX. Say so up front."""
    aval = jax.typeof(x)
    if getattr(aval, "vma", None) or getattr(getattr(aval, "mat", None), "varying", None):
        raise ValueError("the Pallas AllReduce kernels (@pallas) need a shard_map with "
                         "check_vma=False (the model's programs use that with @pallas)")


def meet_neighbours(axis_names: tuple[str, ...]):
    """Inside a kernel whose part q runs along mesh axis `axis_names[q]`: a barrier with both
    neighbours on every part's axis (so that they are in the kernel, their buffers allocated,
    before the first remote DMA), then (index, mesh_id, neighbours): this device's index on
    each axis, mesh_id(q, device) the device id of index `device` on part q's axis (the other
    coordinates this device's), neighbours(q) its (left, right)."""
    index = [lax.axis_index(a) for a in axis_names]
    sizes = [lax.axis_size(a) for a in axis_names]

    def mesh_id(q, device):
        return {axis_names[q]: device}

    def neighbours(q):
        return lax.rem(index[q] + sizes[q] - 1, sizes[q]), lax.rem(index[q] + 1, sizes[q])

    barrier = pltpu.get_barrier_semaphore()
    for q in range(len(axis_names)):
        for neighbour in neighbours(q):
            pl.semaphore_signal(barrier, 1, device_id=mesh_id(q, neighbour),
                                device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, 2 * len(axis_names))
    return index, mesh_id, neighbours


def ring_kernel_call(buf: jax.Array, axis_name: str, p: KernelPlan, out_dtype,
                     interpret=None) -> jax.Array:
    """buf: this device's [N, 2, mh, R, L] partial sums (inside shard_map over `axis_name`)
    -> the reduced message in the same layout and `out_dtype`, identical on every device.
    `interpret`: pltpu.InterpretParams to interpret the kernel, None to compile it."""
    n, mh = p.n_devices, p.minishards
    r, l = p.piece
    if buf.shape != (n, 2, mh, r, l):
        raise ValueError(f"expected a kernel buffer {(n, 2, mh, r, l)}, got {buf.shape}")
    return parts_kernel_call([buf], (axis_name,), p.codec, out_dtype, interpret)[0]


@dataclasses.dataclass(frozen=True)
class PartRing:
    """The static schedule of one part of parts_kernel_call: the ring of `n` devices over its
    axis, `mh` minishards per direction, taken a window of g = min(mh, WINDOW) at a time.

    Per direction s (the same on every device) a window is items (step t, minishard i),
    hop-major, t = 0 .. 2N-2. t <= N-2: reduce-scatter hop, the partial for device d + s (N-1-t),
    the local minishard plus (t > 0) the arrival decoded, encoded and sent; t = N-1: the own
    shard's last partial arrives, and the reduced value is encoded once, kept decoded and sent on;
    N <= t <= 2N-3: all-gather, the arrival forwarded verbatim and decoded; t = 2N-2: decode
    only. A message sent at item (t, i) is consumed at (t+1, i) on the neighbour."""

    n: int
    mh: int
    phase: str

    @property
    def g(self) -> int:
        return min(self.mh, WINDOW)

    @property
    def slots(self) -> int:  # receive slots per direction
        return self.g + 2

    @property
    def steps(self) -> int:
        # Per window: N-1 reduce-scatter hops, then (phase "both") N-1 all-gather hops and a
        # last decode; the reduce-scatter alone ends at the step that adds the last partial.
        return 2 * self.n - 1 if self.phase == "both" else self.n

    @property
    def items(self) -> int:  # per direction
        return self.mh * self.steps

    @property
    def full(self) -> int:  # full windows before the last (which has g or fewer minishards)
        return (self.mh - 1) // self.g

    @property
    def last(self) -> int:
        return self.mh - self.full * self.g

    @property
    def messages(self) -> int:
        return (self.steps - 1) * self.mh

    def coords(self, k):
        """Item k -> (window, step, minishard in the window, the window's minishards)."""
        g, steps = self.g, self.steps
        w = jnp.minimum(lax.div(k, steps * g), self.full)
        rest = k - w * (steps * g)
        size = jnp.where(w < self.full, g, self.last)
        return w, lax.div(rest, size), lax.rem(rest, size), size

    def static_step(self, k: int) -> int:
        w = min(k // (self.steps * self.g), self.full)
        return (k - w * self.steps * self.g) // (self.g if w < self.full else self.last)

    def message(self, w, t, i, size):
        """The index of the message sent at item (w, t, i) (t <= steps - 2)."""
        return w * (self.steps - 1) * self.g + t * size + i


class _PartsKernel:
    """One trace of parts_kernel_call's kernel: the refs it was handed, the parts' static rings
    and this device's place on the mesh. Each item of each stream is traced in the same order
    as one closure would, in methods short enough to read one step at a time.

    Flow control: one send per direction is in flight (waited for at the next item); messages
    land in S = g + 2 receive slots (message m in slot m mod S), and before reusing a slot the
    sender waits on a "capacity" semaphore that the receiver signals once it has decoded and
    forwarded the message. With S = g + 2 every wait is on an earlier item, so the ring cannot
    deadlock; the last S messages are never released and their waits never happen, so every
    semaphore is zero at exit. A barrier with both neighbours precedes the first remote DMA."""

    def __init__(self, refs, axis_names: tuple[str, ...], rings: list[PartRing],
                 codec: KernelCodec, phase: str):
        n_parts = len(rings)
        self.rings, self.codec, self.phase = rings, codec, phase
        self.scaled = codec.scale_shape is not None
        self.x_hbms, self.out_hbms = refs[:n_parts], refs[n_parts:2 * n_parts]
        self.xin, self.stage, self.send_p, self.recv_p, *rest = refs[2 * n_parts:]
        self.send_s = self.recv_s = None
        if self.scaled:
            self.send_s, self.recv_s, *rest = rest
        self.local_sem, self.out_sem, self.send_sem, self.recv_sem, self.capacity = rest
        self.index, self.mesh_id, self.neighbours = meet_neighbours(axis_names)

    def shard(self, q, offset):  # absolute shard of relative offset (any sign, |offset| < N)
        return lax.rem(self.index[q] + offset + self.rings[q].n, self.rings[q].n)

    def local_copy(self, j, k):
        """The local minishard item k of stream j reads (step <= N-1)."""
        q, h = divmod(j, 2)
        pr = self.rings[q]
        w, t, i, _ = pr.coords(k)
        src = self.shard(q, (1 - 2 * h) * (pr.n - 1 - t))  # t = N-1: the own shard
        return pltpu.make_async_copy(self.x_hbms[q].at[src, h, w * pr.g + i],
                                     self.xin.at[j, lax.rem(k, 2)],
                                     self.local_sem.at[j, lax.rem(k, 2)])

    def out_copy(self, j, k):
        """Item k's output minishard (step >= N-1) back to HBM."""
        q, h = divmod(j, 2)
        pr = self.rings[q]
        w, t, i, _ = pr.coords(k)
        if self.phase == "rs":
            dst = self.out_hbms[q].at[h, w * pr.g + i]
        else:
            owner = self.shard(q, -(1 - 2 * h) * (t - (pr.n - 1)))  # t = N-1: the own shard
            dst = self.out_hbms[q].at[owner, h, w * pr.g + i]
        return pltpu.make_async_copy(self.stage.at[j, lax.rem(k, 2)], dst,
                                     self.out_sem.at[j, lax.rem(k, 2)])

    def remote(self, j, m, src_slot=None, send_slot=0):
        """Message m of stream j into the neighbour's receive slot m mod S: from send
        buffer `send_slot`, or forwarded from this device's receive slot `src_slot`."""
        q, h = divmod(j, 2)
        left, right = self.neighbours(q)
        dst = right if h == 0 else left
        slot = lax.rem(m, self.rings[q].slots)
        copies = []
        kinds = [(self.send_p, self.recv_p)] + ([(self.send_s, self.recv_s)] if self.scaled else [])
        for kind, (send_buf, recv_buf) in enumerate(kinds):
            src = send_buf.at[j, send_slot] if src_slot is None else recv_buf.at[j, src_slot]
            copies.append(pltpu.make_async_remote_copy(
                src, recv_buf.at[j, slot], self.send_sem.at[j, kind],
                self.recv_sem.at[j, slot, kind],
                device_id=self.mesh_id(q, dst), device_id_type=pl.DeviceIdType.MESH))
        return copies

    def item(self, j, k):
        q, h = divmod(j, 2)
        pr = self.rings[q]
        n = pr.n
        left, right = self.neighbours(q)
        sender = left if h == 0 else right  # who sends to this device in stream j
        w, t, i, size = pr.coords(k)
        got = pr.message(w, t - 1, i, size)  # the message this item consumes (t >= 1)
        got_slot = lax.rem(got, pr.slots)
        mine = lax.rem(k, 2)

        # 1. This item's local minishard (prefetched); prefetch the next item's.
        @pl.when(t <= n - 1)
        def _():
            self.local_copy(j, k).wait()

        @pl.when((k + 1 < pr.items) & (pr.coords(k + 1)[1] <= n - 1))
        def _():
            self.local_copy(j, k + 1).start()

        # The output buffer this item may write was last written back at item k - 2.
        @pl.when((k >= 2) & (pr.coords(k - 2)[1] >= n - 1))
        def _():
            self.out_copy(j, k - 2).wait()

        # 2. The message the neighbour sent at its item k - window has landed.
        @pl.when(t >= 1)
        def _():
            for c in self.remote(j, got):
                c.wait_recv()

        self.compute(j, k, t, got_slot, mine)
        self.release(j, k, sender)
        self.send(j, (w, t, i, size), got_slot, mine)

    def compute(self, j, k, t, got_slot, mine):
        """3. A reduce-scatter partial to encode, or an output to decode."""
        n, codec, scaled = self.rings[j // 2].n, self.codec, self.scaled

        def local():
            return self.xin[j, mine].astype(jnp.float32)

        def received():
            return codec.decode(self.recv_p[j, got_slot],
                                self.recv_s[j, got_slot] if scaled else None)

        def encode_to_send(v):
            q_, sc = codec.encode(v)
            self.send_p[j, mine] = q_
            if scaled:
                self.send_s[j, mine] = sc
            return q_, sc

        def stage_out(v):
            self.stage[j, mine] = v.astype(self.stage.dtype)
            self.out_copy(j, k).start()

        @pl.when(t == 0)
        def _():
            encode_to_send(local())

        @pl.when((t >= 1) & (t <= n - 2))
        def _():
            encode_to_send(received() + local())

        if self.phase == "rs":
            @pl.when(t == n - 1)
            def _():
                stage_out(local() + received())
        else:
            @pl.when(t == n - 1)
            def _():
                stage_out(codec.decode(*encode_to_send(local() + received())))

            @pl.when(t >= n)
            def _():
                stage_out(received())

    def release(self, j, k, sender):
        """4. Flow control. Item k - 1's send is complete: its send buffer is free, and so is
        the receive slot item k - 1 consumed (decoded, and forwarded if it was)."""
        q = j // 2
        pr = self.rings[q]

        @pl.when(k >= 1)
        def _():
            w1, t1, i1, size1 = pr.coords(k - 1)

            @pl.when(t1 <= pr.steps - 2)
            def _():
                for c in self.remote(j, 0):
                    c.wait_send()

            release = pr.message(w1, t1 - 1, i1, size1)

            @pl.when((t1 >= 1) & (release + pr.slots < pr.messages))
            def _():
                pl.semaphore_signal(self.capacity.at[j], 1, device_id=self.mesh_id(q, sender),
                                    device_id_type=pl.DeviceIdType.MESH)

    def send(self, j, coords, got_slot, mine):
        """5. Send this item's message once the neighbour has freed its slot."""
        pr = self.rings[j // 2]
        w, t, i, size = coords

        @pl.when(t <= pr.steps - 2)
        def _():
            sent = pr.message(w, t, i, size)

            @pl.when(sent >= pr.slots)
            def _():
                pl.semaphore_wait(self.capacity.at[j], 1)

            @pl.when(t <= pr.n - 1)
            def _():
                for c in self.remote(j, sent, send_slot=mine):
                    c.start()

            @pl.when(t >= pr.n)
            def _():
                for c in self.remote(j, sent, src_slot=got_slot):
                    c.start()

    def run(self):
        streams = 2 * len(self.rings)
        max_items = max(pr.items for pr in self.rings)
        for j in range(streams):
            self.local_copy(j, 0).start()

        def body(k, carry):
            for j in range(streams):
                if self.rings[j // 2].items == max_items:
                    self.item(j, k)
                else:  # a shorter part: done once its own items are
                    pl.when(k < self.rings[j // 2].items)(lambda j=j: self.item(j, k))
            return carry

        lax.fori_loop(0, max_items, body, 0)
        # Drain the last two output copies of each stream (every send was waited for in the
        # loop: an item that sends is followed by one of the same window).
        for j in range(streams):
            pr = self.rings[j // 2]
            for k in (pr.items - 2, pr.items - 1):
                if k >= 0 and pr.static_step(k) >= pr.n - 1:
                    self.out_copy(j, k).wait()


def parts_kernel_call(bufs, axis_names: tuple[str, ...], codec: KernelCodec, out_dtype,
                      interpret=None, phase: str = "both") -> list[jax.Array]:
    """The ring over several parts at once, part q along mesh axis `axis_names[q]` (distinct
    axes, of any sizes: two parts on one axis would share the neighbours' slots). bufs[q]:
    this device's [N_q, 2, mh_q, R, L] partial sums of part q (N_q its axis' size; one piece
    shape and dtype for all). phase "both": the all-reduce, out[q] [N_q, 2, mh_q, R, L] in
    `out_dtype`; "rs": the reduce-scatter alone, out[q] [2, mh_q, R, L] float32, this device's
    shard of part q summed over its axis (the last partial received is decoded and added, not
    encoded again: equarx.ring.ring_reduce_scatter's result). Parts on shorter rings or with
    fewer minishards finish their items earlier; every wait is on an earlier item of the same
    part, so the parts never wait on each other."""
    bufs = list(bufs)
    n_parts = len(bufs)
    if len(axis_names) != n_parts or len(set(axis_names)) != n_parts:
        raise ValueError(f"need {n_parts} distinct axes, one per part, got {axis_names}")
    if phase not in ("both", "rs"):
        raise ValueError(f"phase must be 'both' or 'rs', got {phase!r}")
    r, l = bufs[0].shape[-2:]
    in_dtype = bufs[0].dtype
    for b, a in zip(bufs, axis_names):
        if (b.ndim != 5 or b.shape[0] != lax.axis_size(a) or b.shape[1] != 2
                or b.shape[3:] != (r, l) or b.dtype != in_dtype):
            raise ValueError(f"part buffers must be [N, 2, mh, {r}, {l}] {in_dtype} with N the "
                             f"size of their axis, got {[(b.shape, b.dtype) for b in bufs]} on "
                             f"axes of {[lax.axis_size(a) for a in axis_names]}")
    rings = [PartRing(b.shape[0], b.shape[2], phase) for b in bufs]
    streams = 2 * n_parts  # stream j: part j // 2, direction j % 2 (0: +1, 1: -1)
    max_slots = max(pr.slots for pr in rings)
    scaled = codec.scale_shape is not None
    if phase == "rs":
        out_dtype = jnp.float32

    def kernel(*refs):
        _PartsKernel(refs, axis_names, rings, codec, phase).run()

    scratch = [pltpu.VMEM((streams, 2, r, l), in_dtype), pltpu.VMEM((streams, 2, r, l), out_dtype),
               pltpu.VMEM((streams, 2, r, l), codec.wire_dtype),
               pltpu.VMEM((streams, max_slots, r, l), codec.wire_dtype)]
    if scaled:
        scratch += [pltpu.VMEM((streams, 2, *codec.scale_shape), codec.scale_dtype),
                    pltpu.VMEM((streams, max_slots, *codec.scale_shape), codec.scale_dtype)]
    scratch += [pltpu.SemaphoreType.DMA((streams, 2)), pltpu.SemaphoreType.DMA((streams, 2)),
                pltpu.SemaphoreType.DMA((streams, TRANSPORTS)),
                pltpu.SemaphoreType.DMA((streams, max_slots, TRANSPORTS)),
                pltpu.SemaphoreType.REGULAR((streams,))]
    vmem_limit = (n_parts * vmem_per_part(codec, (r, l), max_slots - 2, in_dtype, out_dtype)
                  + VMEM_MARGIN)
    out_shapes = [jax.ShapeDtypeStruct(b.shape if phase == "both" else b.shape[1:], out_dtype)
                  for b in bufs]
    call = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * n_parts,
        out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * n_parts,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(collective_id=COLLECTIVE_ID,
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret if interpret is not None else False,
    )
    return list(call(*bufs))


def plan_for(config: AllReduceConfig, shape: tuple[int, ...], n_devices: int,
             min_piece: int = MIN_PIECE_ELEMENTS,
             max_piece: int = MAX_PIECE_ELEMENTS) -> KernelPlan:
    """The kernel's plan for `config` on `n_devices` shards (equarx.pallas_codecs.plan)."""
    if config.variant not in ("auto", "full") or config.phases != "both":
        raise ValueError(f"the Pallas kernel runs the full-loop ring with both phases "
                         f"quantized, not {config.label!r}")
    return plan(config.method, config.blocks, config.group_size, tuple(shape), n_devices,
                config.minishards, min_piece, max_piece)


def all_reduce(x: jax.Array, axis_name: str, config: AllReduceConfig, interpret="auto",
               min_piece: int = MIN_PIECE_ELEMENTS, rotated: bool = False) -> jax.Array:
    """equarx.all_reduce's ring path through the kernel (x: this device's partial sum, a
    floating array of any shape; inside shard_map). `interpret`: "auto" interprets off TPU,
    None compiles for TPU (lowering on any machine), or pltpu.InterpretParams. `min_piece`:
    the smallest minishard, in values (see pallas_codecs.plan). `rotated`: as in
    equarx.all_reduce (x's rows already carry the group codec's rotation)."""
    check_untyped(x)
    if interpret == "auto":
        interpret = interpret_default()

    def run(buf, p, out_dtype):
        return p.from_kernel(ring_kernel_call(p.to_kernel(buf), axis_name, p, out_dtype,
                                              interpret))

    return _around(x, axis_name, config, run, min_piece, rotated)


def reference_all_reduce(x: jax.Array, axis_name: str, config: AllReduceConfig,
                         min_piece: int = MIN_PIECE_ELEMENTS) -> jax.Array:
    """The kernel's schedule run by the ppermute implementation (equarx.ring's functions and
    equarx.codecs' codecs on the kernel's layout): bitwise what `all_reduce` computes."""

    def run(buf, p, out_dtype):
        codec = reference_codec(p.codec)
        chains = reference_chains(p)
        y = ring.ring_reduce_scatter(buf, axis_name, chains, codec, p.layout)
        return ring.ring_all_gather(y, axis_name, chains, codec, p.layout, out_dtype)

    return _around(x, axis_name, config, run, min_piece)


def reference_codec(codec: KernelCodec) -> codecs.Codec:
    """The equarx.codecs codec that computes what a kernel codec computes, on the layout's own
    pieces (the tile layout's [K, 8, 128], the token layout's [Tm, W] rows)."""
    if isinstance(codec, TileCodec):
        return codecs.FlatInt8Codec(rows=False)
    if isinstance(codec, GroupCodec):
        return codecs.GroupCodec(codec.group, "int8", (codec.lanes, codec.rows))
    return codecs.FloatCodec(jnp.bfloat16)


def _around(x, axis_name, config, run, min_piece, rotated=False):
    """What both implementations do around the schedule: the plan, the group codec's rotation
    (on the caller's rows, as equarx.collective does; skipped when they come `rotated`), the
    split and the join."""
    p = plan_for(config, x.shape, lax.axis_size(axis_name), min_piece)
    grouped = isinstance(p.codec, GroupCodec)
    x_in = groups.message_rows(x, config.group_size, rotated) if grouped else x
    out = run(p.layout.split(x_in), p, jnp.float32 if grouped else x.dtype)
    if grouped:
        return groups.unrotate_rows(p.layout.join_rows(out), config.group_size,
                                    x.shape).astype(x.dtype)
    return p.layout.join(out, x.shape).astype(x.dtype)


__all__ = ["FloatCodec", "GroupCodec", "KernelPlan", "PartRing", "TileCodec", "all_reduce",
           "parts_kernel_call", "plan_for", "reference_all_reduce", "reference_chains",
           "reference_codec", "ring_kernel_call", "vmem_bytes"]
