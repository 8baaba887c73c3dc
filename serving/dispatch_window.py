"""How far the engine's dispatches may run ahead of the devices: the one place that bounds it.

XLA:CPU with several devices in one process deadlocks once a device holds 32 unfinished
computations. So the engine counts the programs it dispatches and, once `limit` are not known to
have finished, waits for all (a full drain: the donated KV cache leaves little to wait on later).
See docs/engine.md, "Why a tp >= 2 server wedged on long prompts"."""
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
