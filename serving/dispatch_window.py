"""How far the engine's dispatches may run ahead of the devices: the one place that bounds it.

JAX dispatches a program and returns before it has run, so an engine thread that feeds a long
prompt's chunks (two programs each, no result read back until the last) can queue dozens of
programs. XLA:CPU (the PjRt CPU client, jaxlib 0.10) cannot take that with several devices in one
process: it admits at most 32 unfinished computations per device (a semaphore,
`CpuClientOptions::max_inflight_computations_per_device`, which JAX does not expose), and a
multi-device program takes that semaphore on a thread of the client's pool, whose size is
max(cores, devices), the very threads that run the devices' programs. Once a device has 32
computations queued, the pool threads that dispatch the next program block on the semaphore,
while the device's queued collective needs a pool thread for its other participant: the collective
never completes and XLA reports "Expected 2 threads to join the rendezvous, but not all of them
arrived", then aborts the process. docs/engine.md ("Why a tp >= 2 server wedged on long prompts")
has the thread stacks and a standalone reproduction.

So the engine counts every program it dispatches and, once `limit` of them are not known to have
finished, waits until all have (`DispatchWindow.dispatched`). A program is known to have finished
after a wait, or once the host read back an output that depends on it (`retired`: a decode
step's sampled tokens, read one step late by the overlapped loop, which so never waits here).
At most `limit` programs (plus the few of one engine call) are ever unfinished on any device, far
below the runtime's 32, whatever the engine dispatches and however slow the devices are. The cost
is one short pipeline bubble (the host's dispatch time of a program) every `limit` programs of a
stretch that reads nothing back, such as a long prompt's chunks.

Only XLA:CPU with several devices in one process needs it (`needed`): with one device the
runtime takes the semaphore on the dispatching thread, and a TPU or GPU runtime blocks the
dispatching thread (not a device's) when its queue is full. Elsewhere the window only counts.

Why a full drain and not a sliding window: the engine's programs donate the KV cache to the next
one, so most programs leave no output that can be waited on later; the newest cache (which every
earlier cache program precedes, by data dependence) and the outputs that are never donated
(sampled tokens, logits, a chunk's keys and values) together cover every program dispatched.
"""
from __future__ import annotations

from typing import Callable

# The XLA:CPU runtime's per-device limit (see the module docstring).
XLA_CPU_MAX_INFLIGHT = 32
DEFAULT_LIMIT = 20


def needed(devices) -> bool:
    """Whether programs over `devices` (this process's devices of a mesh) can wedge the runtime
    when queued: XLA:CPU with more than one of them."""
    devices = list(devices)
    return len(devices) > 1 and all(d.platform == "cpu" for d in devices)


class DispatchWindow:
    """Counts dispatched programs; once `limit` are not known to have finished, waits until all
    have (limit 0: never waits, only counts).

    latest: returns the arrays that every program dispatched so far without a kept output
    precedes (the engine's newest KV cache)."""

    def __init__(self, latest: Callable[[], object], limit: int = DEFAULT_LIMIT):
        if not 0 <= limit <= XLA_CPU_MAX_INFLIGHT - 8:  # room for one engine call's programs
            raise ValueError(f"the dispatch window must be 0..{XLA_CPU_MAX_INFLIGHT - 8} programs, "
                             f"got {limit}")
        self.limit = limit
        self._latest = latest
        self._total = 0  # programs dispatched so far
        self._done = 0  # of which the first _done are known to have finished
        self._kept: list = []  # (ticket, output) of unfinished programs that no program donates
        self.drains = 0  # waits so far (for tests and logs)
        self.most_unfinished = 0  # the most programs not known to have finished

    @property
    def unfinished(self) -> int:
        """Programs dispatched and not known to have finished."""
        return self._total - self._done

    def dispatched(self, outputs=(), programs: int = 1) -> int:
        """Call after dispatching `programs` programs; `outputs` are arrays they returned that
        no later program donates (others may be left out: the newest cache covers them).
        Returns a ticket for `retired`."""
        self._total += programs
        self.most_unfinished = max(self.most_unfinished, self.unfinished)
        if self.limit:
            import jax

            self._kept.extend((self._total, x) for x in jax.tree.leaves(outputs)
                              if isinstance(x, jax.Array))
            if self.unfinished >= self.limit:
                self.drain()
        return self._total

    def retired(self, ticket: int) -> None:
        """The host has read back an output that depends on every program dispatched up to
        `ticket` (the engine's sampled tokens: each depends on its step's logits, so on the
        whole cache chain before it, and on the tokens fed from the step before): those have
        finished. Keeps the overlapped decode loop, which reads every step back one step late,
        from ever reaching a drain."""
        if ticket > self._done:
            self._done = ticket
            self._kept = [(t, x) for t, x in self._kept if t > ticket]

    def drain(self) -> None:
        """Waits until every program dispatched so far has finished."""
        import jax

        waits = [x for _, x in self._kept if not x.is_deleted()]
        waits += [x for x in jax.tree.leaves(self._latest())
                  if isinstance(x, jax.Array) and not x.is_deleted()]
        jax.block_until_ready(waits)
        self._kept.clear()
        self._done = self._total
        self.drains += 1

    def reset(self) -> None:
        """Forget what was dispatched (after a failed step: nothing of it will be waited on)."""
        self._kept.clear()
        self._done = self._total
