"""A batch of sequences stepped through a `PagedRunner` without the scheduler: the decode steps
the benchmarks time on their own (bench_paged's `step`, bench_dispatch_window, bench_serving's
--engine-ratio, bench_grammar), built from the same public pieces the engine core uses
(`Piece`, `StepPlan`, `KVPages`, `step_inputs`).

Every row computes one piece a step: its whole prompt first (unless it starts decoding at once,
`decode_batch`), then one token. Its pages are taken a step at a time as the scheduler takes
them (the global table grows, the window's local pages go back), in a table of this batch's
own: to the runner its pages are only arrays, and what they hold does not change a step's time.
"""
from __future__ import annotations


class DecodeBatch:
    """The rows `seqs` (serving.Sequence) over a runner with `info` (its RunnerInfo).

    `inputs()` builds the next step; `accept(tokens)` hands the rows the tokens a step sampled,
    which the next step then reads on the host. A step built before its predecessor's tokens
    were accepted (`inputs(fed=True)`) takes them from that step on the device: run it with
    `PagedRunner.dispatch_step(inputs, prev)`, as the engine core's overlapped loop does."""

    def __init__(self, info, seqs):
        from serving import KVPages

        self.info = info
        self.seqs = list(seqs)
        self.kv = KVPages(info.page_size, info.num_global_pages, info.num_local_pages,
                          info.sliding_window, info.has_global_layers)

    def inputs(self, extras=None, fed: bool = False):
        """The next step's StepInputs. extras(rows) -> LogitsExtras | None: the rows' logits
        processing (as the engine core's `step_extras`)."""
        from serving import Piece, StepPlan, step_inputs

        pieces = []
        for s in self.seqs:
            # A piece ends at the text's end, or one token further when that token is the
            # step in flight's sample (not accepted yet).
            start, end = s.computed, max(s.computed + 1, s.length)
            self.kv.allocate(s.id, start, end)
            pieces.append(Piece(s, start, end, sample=True, fed=end > s.length))
            s.computed = end
        prev_rows = {s.id: row for row, s in enumerate(self.seqs)} if fed else None
        return step_inputs(StepPlan(tuple(pieces)), self.kv, self.info, extras, prev_rows)

    def accept(self, tokens) -> None:
        """Each row's sampled token (tokens[row]; padding rows after them are ignored)."""
        for s, t in zip(self.seqs, tokens):
            s.generated.append(int(t))


def decode_batch(info, rows: int, context: int, token: int, params=None) -> DecodeBatch:
    """`rows` sequences of `context` copies of `token`, decoding from their first step on
    (position context - 1): their prompts' keys are never computed, so a batch starts at any
    context at once. params: every row's SamplingParams (default greedy)."""
    from serving import IDLE, Sequence

    seqs = [Sequence(id=i, prompt=[token] * context, params=params or IDLE, seed=i)
            for i in range(rows)]
    for s in seqs:
        s.computed = context - 1
    return DecodeBatch(info, seqs)
