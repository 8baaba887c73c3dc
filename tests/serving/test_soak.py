"""Load and soak through a real `gemma3-serve` process (eval.soak, small random model): 64
concurrent streams each equal to the request alone; a soak of whole, cancelled, dropped and bad
requests leaves every slot free, the resident memory flat, and the server still answering as
before."""
from eval import soak
from testkit import free_port


def test_64_streams_and_a_soak_leave_nothing_behind(tmp_path):
    report = soak.run("random:tiny", streams=64, seconds=12, concurrency=12, port=free_port(),
                      server_log=str(tmp_path / "server.log"), log=lambda *a: None)
    assert report["load"]["streams"] == 64 and report["load"]["wrong"] == []
    counts = report["soak"]["requests"]
    assert all(counts[k] > 0 for k in ("whole", "cancelled", "dropped", "bad")), counts
    assert report["soak"]["wrong"] == [] and report["soak"]["bad_request_5xx"] == []
    assert report["after"]["num_requests_running"] == 0
    assert report["after"]["num_requests_waiting"] == 0
    assert report["after"]["kv_cache_usage_perc"] == 0
    # Every reference ran its whole length (ignore_eos), so the comparisons compared something.
    assert [len(r[1]) for r in report["references"]] == soak.MAX_TOKENS
    assert report["checks"] == {k: True for k in report["checks"]}, report["checks"]
