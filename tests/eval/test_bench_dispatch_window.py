from eval import bench_dispatch_window


def test_bench_dispatch_window_runs_on_a_tiny_model():
    report = bench_dispatch_window.run("random:tiny", tp=2, max_num_seqs=2, steps=8, repeats=1, log=lambda _: None)
    assert report["window_limit"] == 20  # tp=2 on the CPU: the window waits
    assert all(t > 0 for ts in report["ms_per_step"].values() for t in ts) and report["ratio"] > 0
    # The overlapped loop reads every step back one step late, which retires its programs: the
    # window saw steps in flight but never had to wait for them.
    assert report["drains"] == 0 and 0 < report["most_unfinished"] < report["window_limit"]
