"""The scheduling policy, the engine core's step inputs and the output processor on plain data:
no engine, no thread. Each test builds sequences, asks for a plan or feeds step outputs made of
numpy arrays, and checks what comes out."""
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from serving.runner import RunnerInfo, StepOutputs
from serving.engine_core import decode_inputs, prefill_inputs
from serving.fake_runner import ByteTokenizer
from serving.metrics import Metrics
from serving.output_processor import OutputProcessor
from serving.sampling import InvalidParameter, SamplingParams
from serving.scheduler import Plan, QueueFull, Scheduler, Sequence

TOK = ByteTokenizer()


def info(num_slots=4, max_seq_len=64, decode_batch_sizes=(), prefill_batch_sizes=(1, 2, 4)):
    return RunnerInfo(model_name="plain", num_slots=num_slots, max_seq_len=max_seq_len,
                      prefill_buckets=(8, 16, 32, 64), prefill_batch_sizes=prefill_batch_sizes,
                      vocab_size=TOK.vocab_size, eos_ids=(TOK.eos_id, TOK.end_of_turn_id),
                      batched_prefill_max_bucket=16, decode_batch_sizes=decode_batch_sizes)


_ids = iter(range(1, 10**6))


def seq(prompt_len, max_tokens=8, **kw):
    return Sequence(id=next(_ids), prompt=[TOK.bos_id] + [TOK.encode("a")[0]] * (prompt_len - 1),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=7, **kw)


def admit_all(s: Scheduler) -> Plan:
    plan = s.schedule()
    for g in plan.prefills:  # as the engine would: each prefill produces a first token
        for q in g.seqs:
            q.generated.append(300)
    return plan


# ---- admission and prefill groups ----

def test_waiting_prompts_are_prefilled_oldest_first_into_the_lowest_free_slots():
    s = Scheduler(info())
    a, b, c = seq(3), seq(10), seq(5)  # buckets 8, 16, 8: all short, one group
    s.add([a, b, c])
    plan = s.schedule()
    assert not plan.decode and not plan.moves
    (group,) = plan.prefills
    assert group.seqs == (a, b, c) and [q.slot for q in group.seqs] == [0, 1, 2]
    # Padded to the longest prompt's bucket and to the smallest compiled batch that holds 3.
    assert (group.bucket, group.batch) == (16, 4)
    assert s.num_waiting == 0 and s.num_running == 3


def test_long_prompts_and_prompt_logprobs_go_alone():
    s = Scheduler(info())
    short1, long1, short2, scored = seq(4), seq(20), seq(4), seq(4, want_prompt_logprobs=True)
    s.add([short1, long1, short2, scored])
    plan = s.schedule()
    assert [g.seqs for g in plan.prefills] == [(short1,), (long1,), (short2,), (scored,)]
    assert [(g.bucket, g.batch) for g in plan.prefills] == [(8, 1), (32, 1), (8, 1), (8, 1)]
    assert [g.prompt_logprobs for g in plan.prefills] == [False, False, False, True]


def test_a_group_is_bounded_by_free_slots_and_the_largest_batch():
    s = Scheduler(info(num_slots=4, prefill_batch_sizes=(1, 2)))
    seqs = [seq(3) for _ in range(6)]
    s.add(seqs)
    plan = admit_all(s)
    assert [len(g.seqs) for g in plan.prefills] == [2, 2]  # 4 slots, batches of at most 2
    assert s.num_waiting == 2 and list(s.waiting) == seqs[4:]
    # No free slot: the next step decodes the four.
    plan = s.schedule()
    assert not plan.prefills and plan.decode == tuple(seqs[:4])


def test_prefill_comes_before_decode():
    s = Scheduler(info())
    first = seq(3)
    s.add([first])
    admit_all(s)
    late = seq(3)
    s.add([late])
    plan = s.schedule()
    assert plan.prefills and plan.prefills[0].seqs == (late,) and not plan.decode
    assert s.schedule().decode == (first, late)


def test_nothing_to_do_is_an_empty_plan():
    assert Scheduler(info()).schedule() == Plan()


# ---- decode rows and slot moves ----

def test_decode_covers_the_slots_up_to_the_last_busy_one():
    s = Scheduler(info(num_slots=4))
    a, b, c = seq(3), seq(3), seq(3)
    s.add([a, b, c])
    admit_all(s)
    s.finish(a)
    s.finish(b)
    plan = s.schedule()
    # No smaller compiled program exists (decode_batch_sizes empty): nothing moves.
    assert plan.moves == () and plan.decode == (None, None, c) and plan.decode_rows == 4
    inputs = decode_inputs(plan)
    assert inputs.tokens.tolist() == [0, 0, 300] and inputs.positions.tolist() == [0, 0, 3]
    assert inputs.sampling.temperature.tolist() == [0.0, 0.0, 0.0]


def test_busy_slots_move_down_when_a_smaller_decode_program_fits():
    s = Scheduler(info(num_slots=8, decode_batch_sizes=(1, 2, 4)))
    seqs = [seq(3) for _ in range(8)]
    s.add(seqs)
    admit_all(s)
    for q in seqs[1:7]:
        s.finish(q)
    plan = s.schedule()  # slots 0 and 7 busy: 8 rows without a move, 2 with one
    assert plan.moves == ((7, 1),) and plan.decode == (seqs[0], seqs[7]) and plan.decode_rows == 2
    assert seqs[7].slot == 1 and s.slots[7] is None
    s.finish(seqs[0])
    plan = s.schedule()  # one sequence left, in slot 1: it moves to slot 0 and decodes as 1 row
    assert plan.moves == ((1, 0),) and plan.decode == (seqs[7],) and plan.decode_rows == 1


# ---- leaving, limits, usage ----

def test_abort_takes_waiting_and_running_sequences_out():
    s = Scheduler(info(num_slots=1))
    running, waiting, other = seq(3), seq(3), seq(3)
    s.add([running, waiting, other])
    admit_all(s)
    assert s.abort([running.id, waiting.id, 12345]) == [waiting, running]
    assert s.num_running == 0 and list(s.waiting) == [other]
    assert s.schedule().prefills[0].seqs == (other,)  # the freed slot is taken at once
    assert s.abort_all() == [other] and s.num_running == 0


def test_queue_limit_is_all_or_none_and_the_context_is_checked():
    s = Scheduler(info(max_seq_len=64), max_waiting=2)
    s.add([seq(3)])
    with pytest.raises(QueueFull):
        s.add([seq(3), seq(3)])
    assert s.num_waiting == 1
    with pytest.raises(InvalidParameter) as e:
        s.add([seq(60, max_tokens=10)])
    assert e.value.param == "max_tokens" and s.num_waiting == 1


def test_kv_usage_counts_the_tokens_held_in_slots():
    s = Scheduler(info(num_slots=2, max_seq_len=64))
    a = seq(15)
    s.add([a, seq(3)])
    s.schedule()
    a.generated += [300, 300]
    assert s.kv_usage() == pytest.approx((17 + 3) / 128)


def test_prefill_inputs_pad_rows_and_bucket():
    s = Scheduler(info())
    a, b, c = seq(3), seq(5), seq(2)
    s.add([a, b, c])
    (group,) = s.schedule().prefills
    inputs = prefill_inputs(group)
    assert inputs.tokens.shape == (4, 8) and inputs.lengths.tolist() == [3, 5, 2, 2]
    assert inputs.slots.tolist() == [0, 1, 2, 2]  # padding repeats the last real row
    assert inputs.tokens[1, :5].tolist() == b.prompt and not inputs.prompt_logprobs


# ---- output processing ----

def outputs(tokens):
    n = len(tokens)
    return StepOutputs(np.array(tokens, np.int32), np.full(n, -0.5, np.float32),
                       np.zeros((n, 20), np.int32), np.full((n, 20), -1.0, np.float32))


def decode_plan(*seqs):
    return Plan(decode=seqs, decode_rows=len(seqs))


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
        live = tuple(q if tok is not None else None for q, tok in zip((stop_str, eos, short), toks))
        events = proc.on_decode(decode_plan(*live), outputs([x or 0 for x in toks]), now=1.0 + t)
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
    assert value("gemma3:decode_steps_total", {**labels, "rows": "3"}) == 4
    assert value("gemma3:decode_padding_rows_total", labels) == 0 + 0 + 2 + 2


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
