"""The output processor, the waiting queue and the metrics on plain data: no engine, no
thread. Each test builds sequences, feeds step outputs made of numpy arrays, and checks what
comes out. (The scheduling policy: test_paged_scheduler.py.)"""
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from serving.runner import RunnerInfo, StepOutputs
from serving.detokenize import TextStream
from serving.fake_runner import ByteTokenizer
from serving.metrics import Metrics
from serving.output_processor import OutputProcessor
from serving.paged_scheduler import Piece, PagedScheduler, StepPlan
from serving.sampling import InvalidParameter, SamplingParams
from serving.sequence import QueueFull, Sequence

TOK = ByteTokenizer()


def info(max_num_seqs=4, max_seq_len=64):
    return RunnerInfo(model_name="plain", max_num_seqs=max_num_seqs, max_seq_len=max_seq_len,
                      vocab_size=TOK.vocab_size, eos_ids=(TOK.eos_id, TOK.end_of_turn_id),
                      page_size=4, num_global_pages=65, num_local_pages=65, long_prefill_token_threshold=8,
                      max_num_batched_tokens=32)


_ids = iter(range(1, 10**6))


def seq(prompt_len, max_tokens=8, **kw):
    return Sequence(id=next(_ids), prompt=[TOK.bos_id] + [TOK.encode("a")[0]] * (prompt_len - 1),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=7, **kw)


# ---- the waiting queue ----

def test_abort_takes_waiting_and_running_sequences_out():
    s = PagedScheduler(info(max_num_seqs=1))
    running, waiting, other = seq(3), seq(3), seq(3)
    s.add([running, waiting, other])
    assert [p.seq for p in s.schedule().pieces] == [running]
    assert s.abort([running.id, waiting.id, 12345]) == [waiting, running]
    assert s.num_running == 0 and list(s.waiting) == [other]
    assert [p.seq for p in s.schedule().pieces] == [other]  # its place is taken at once
    assert s.abort_all() == [other] and s.num_running == 0


def test_queue_limit_is_all_or_none_and_the_context_is_checked():
    s = PagedScheduler(info(max_seq_len=64), max_waiting=2)
    s.add([seq(3)])
    with pytest.raises(QueueFull):
        s.add([seq(3), seq(3)])
    assert s.num_waiting == 1
    with pytest.raises(InvalidParameter) as e:
        s.add([seq(60, max_tokens=10)])
    assert e.value.param == "max_tokens" and s.num_waiting == 1


# ---- output processing ----

def outputs(tokens):
    n = len(tokens)
    return StepOutputs(np.array(tokens, np.int32), np.full(n, -0.5, np.float32),
                       np.zeros((n, 20), np.int32), np.full((n, 20), -1.0, np.float32))


def step_plan(seqs):
    """One step of `seqs`: each one's prompt when it has no token yet, else its last token."""
    return StepPlan(pieces=tuple(
        Piece(q, 0, len(q.prompt), admitted=True, sample=True) if not q.generated else
        Piece(q, q.length - 1, q.length, sample=True) for q in seqs))


def test_output_processor_detokenizes_stops_and_records_metrics():
    metrics = Metrics("plain", "bf16")
    proc = OutputProcessor(TOK, info(), metrics)
    stop_str = Sequence(1, [TOK.bos_id, 301], SamplingParams(max_tokens=10, temperature=0.0, stop=("cd",)), 0)
    eos = Sequence(2, [TOK.bos_id, 301], SamplingParams(max_tokens=10, temperature=0.0), 0)
    short = Sequence(3, [TOK.bos_id, 301], SamplingParams(max_tokens=2, temperature=0.0, logprobs=1), 0)
    got = {1: [], 2: [], 3: []}
    for q in (stop_str, eos, short):
        proc.add(q, got[q.id].append, arrival=0.0)
    a, b, c, d = TOK.encode("abcd")
    steps = [[a, a, b], [b, TOK.eos_id, c], [c, None, None], [d, None, None]]
    for t, toks in enumerate(steps):
        live = [(q, tok) for q, tok in zip((stop_str, eos, short), toks) if tok is not None]
        events = proc.on_step(step_plan([q for q, _ in live]), outputs([tok for _, tok in live]),
                              started=0.5 + t, now=1.0 + t)
        proc.deliver(events)
    text = {k: "".join(e.text for e in v) for k, v in got.items()}
    reasons = {k: v[-1].finish_reason for k, v in got.items()}
    assert text == {1: "ab", 2: "a", 3: "bc"}
    assert reasons == {1: "stop", 2: "stop", 3: "length"}
    assert got[2][-1].num_generated == 2 and got[2][-1].tokens == ()  # EOS counts, is not shown
    assert [t.logprob for e in got[3] for t in e.tokens] == [-0.5, -0.5]
    # "c" of the stop string was held back while it could start "cd"; the step with "d" ended it.
    assert [e.text for e in got[1]] == ["a", "b", "", ""]
    value = metrics.registry.get_sample_value
    labels = {"model_name": "plain", "allreduce": "bf16"}
    assert value("gemma3:generation_tokens_total", labels) == 4 + 2 + 2
    assert value("gemma3:request_success_total", {**labels, "finished_reason": "stop"}) == 2
    # The first step computed the prompts; the decode steps ran 3, 1 and 1 sequences.
    assert value("gemma3:decode_steps_total", {**labels, "rows": "3"}) == 1
    assert value("gemma3:decode_steps_total", {**labels, "rows": "1"}) == 2
    assert value("gemma3:prompt_tokens_total", labels) == 3 * 2




def test_stop_strings_wait_for_min_tokens():
    """As in vLLM, no stop string ends a sequence before min_tokens tokens: "b" in the first 3
    is text, the "b" after them stops it (and is cut, as a stop string is)."""
    proc = OutputProcessor(TOK, info())
    q = Sequence(1, [TOK.bos_id, 301], SamplingParams(max_tokens=10, temperature=0.0, stop=("b",),
                                                      min_tokens=3), 0)
    got = []
    proc.add(q, got.append, arrival=0.0)
    for t, tok in enumerate(TOK.encode("abcbd")):
        if got and got[-1].finish_reason:
            break
        proc.deliver(proc.on_step(step_plan([q]), outputs([tok]), started=t, now=t + 0.5))
    assert "".join(e.text for e in got) == "abc" and got[-1].finish_reason == "stop"
    assert got[-1].num_generated == 4


def test_text_stream_min_tokens_finds_only_matches_ending_after_them():
    """A stop string that ended within the first min_tokens tokens is not matched later (vLLM
    searches only the text new since its last check); one that ends after them is, and what
    streamed before it never includes a part of it."""
    tok = ByteTokenizer()
    s = TextStream(tok, ["aa", "xyz"], min_tokens=3)
    deltas = [s.add(i) for i in tok.encode("caay")]
    assert deltas[-1] == ("aay", False) and "".join(d for d, _ in deltas) == "caay"
    s = TextStream(tok, ["aa"], min_tokens=2)
    deltas = [s.add(i) for i in tok.encode("caa")]
    assert "".join(d for d, _ in deltas) == "c" and deltas[-1][1] and s.text == "c"


def test_output_processor_ends_sequences_aborted_from_outside():
    proc = OutputProcessor(TOK, info())
    q = seq(3)
    got = []
    proc.add(q, got.append, arrival=0.0)
    proc.deliver(proc.finish([q], "error", "device lost", now=1.0))
    assert [(e.finish_reason, e.error) for e in got] == [("error", "device lost")]
    assert proc.finish([q], "abort", None, now=2.0) == []  # already ended: no second last event


def test_metrics_leave_out_created_series_without_a_process_wide_switch():
    text = Metrics("plain", "bf16").render().decode()
    assert "gemma3:generation_tokens_total" in text and "_created" not in text
    other = CollectorRegistry()
    Counter("unrelated", "A counter of another registry.", registry=other)
    assert "unrelated_created" in generate_latest(other).decode()


def test_a_sequence_whose_output_fails_ends_alone():
    """A token one sequence cannot turn into text (its tokenizer refuses it) fails that sequence
    with an error; the others in the step go on, and so do later steps."""
    class Refusing(ByteTokenizer):
        def decode(self, ids):
            if 299 in ids:
                raise ValueError("token id 299 out of range")
            return super().decode(ids)

    proc = OutputProcessor(Refusing(), info(), Metrics("plain", "bf16"))
    bad, good = seq(2), seq(2)
    got = {bad.id: [], good.id: []}
    for q in (bad, good):
        proc.add(q, got[q.id].append, 0.0)
    a, b = TOK.encode("ab")
    proc.deliver(proc.on_step(step_plan([bad, good]), outputs([299, a]), 0.0, 1.0))
    [end] = got[bad.id]
    assert end.finish_reason == "error" and "299 out of range" in end.error
    assert not proc.is_live(bad.id) and proc.is_live(good.id)
    assert got[good.id][0].finish_reason is None
    proc.deliver(proc.on_step(step_plan([good]), outputs([b]), 1.0, 2.0))
    assert "".join(e.text for e in got[good.id]) == "ab" and len(got[bad.id]) == 1
