"""Pure helpers of bench/soak.py and bench/_common.py: the least-squares slope, naming a run's processes
from their command lines, the per-process summary and the incremental metrics reader. No run here."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import soak  # noqa: E402

MB = 2**20


def test_least_squares_slope_fits_a_noisy_line():
    xs = list(range(10, 1000, 5))
    noise = [(-1) ** i * 3e5 for i in range(len(xs))]  # +-0.3 MB, alternating
    ys = [500 * MB + 0.02 * MB * x + e for x, e in zip(xs, noise)]  # 2 MB per 100 steps
    slope, se = _common.least_squares_slope(xs, ys)
    assert slope * 100 / MB == pytest.approx(2.0, abs=0.01)
    assert 0 < se * 100 / MB < 0.05
    # a two-point "slope" would read the noise at the ends; the fit does not
    assert _common.least_squares_slope([1, 2], [1.0, 3.0]) == (2.0, pytest.approx(math.nan, nan_ok=True))
    assert all(math.isnan(v) for v in _common.least_squares_slope([3], [1.0]))
    assert all(math.isnan(v) for v in _common.least_squares_slope([3, 3, 3], [1.0, 2.0, 3.0]))
    with pytest.raises(ValueError):
        _common.least_squares_slope([1, 2], [1.0])


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        ("ray::TrainerWorker" + " " * 40, "trainer"),
        ("ray::TrainerWorker.train_step", "trainer"),
        ("ray::RolloutWorker.generate", "engine"),
        ("ray::DashboardAgent", "dashboard agent"),
        ("ray::RuntimeEnvAgent", "runtime env agent"),
        ("ray::IDLE", "idle Ray worker"),
        ("ray::SomethingElse.f", "Ray worker SomethingElse"),
        ("/x/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray/session/logs", "gcs_server"),
        ("/x/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s", "raylet"),
        ("/x/python /x/ray/dashboard/dashboard.py --host=127.0.0.1", "dashboard head"),
        ("/x/python -u /x/ray/_private/log_monitor.py --session-dir=/tmp", "log monitor"),
        ("/x/python -u /x/ray/autoscaler/_private/monitor.py --logs-dir=/tmp", "autoscaler monitor"),
        ("/x/python -B -c from multiprocessing.resource_tracker import main;main(5)", "resource tracker"),
        (
            "/x/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=6)",
            "spawn child",
        ),
        ("/x/python /x/ray/_private/workers/default_worker.py --node-ip-address=1", "Ray worker (starting)"),
        ("/x/.venv/bin/python -m rl_tpu.commands.cli train --logging.run_dir=/tmp/r", "driver"),
        ("", "?"),
    ],
)
def test_process_kind_from_cmdline(cmdline, kind):
    assert soak.process_kind(cmdline) == kind


def test_name_processes_roles_ranks_and_duplicates():
    driver = 100
    procs = [
        (100, 1, "/x/python -m rl_tpu.commands.cli train", "python"),
        (101, 100, "/x/ray/gcs/gcs_server --x", "gcs_server"),
        (102, 100, "/x/raylet/raylet --x", "raylet"),
        (103, 100, "python -c from multiprocessing.spawn import spawn_main; spawn_main()", "python"),
        (104, 100, "python -c from multiprocessing.spawn import spawn_main; spawn_main()", "python"),
        (110, 102, "ray::TrainerWorker.train_step", "ray::TrainerWor"),
        (111, 102, "ray::TrainerWorker", "ray::TrainerWor"),
        (112, 102, "ray::RolloutWorker.generate", "ray::RolloutWor"),
        (113, 102, "ray::RolloutWorker", "ray::RolloutWor"),
        (114, 113, "VLLM::EngineCore", "VLLM::EngineCor"),
        (115, 102, "ray::DashboardAgent", "ray::DashboardA"),
        (116, 102, "ray::IDLE", "ray::IDLE"),
        (117, 102, "ray::IDLE", "ray::IDLE"),
    ]
    known = {112: "engine 1", 113: "engine 0", 111: "trainer rank 0"}
    names = soak.name_processes(procs, driver, known)
    assert names[100] == "driver"
    assert names[101] == "gcs_server" and names[102] == "raylet"
    assert (names[103], names[104]) == ("reward worker 0", "reward worker 1")
    assert names[111] == "trainer rank 0"
    assert names[110] == "trainer #0 by pid"  # placement.json gave no pid for it
    assert (names[112], names[113]) == ("engine 1", "engine 0")
    assert names[114] == "engine 0 child VLLM::EngineCor"
    assert names[115] == "dashboard agent"
    assert (names[116], names[117]) == ("idle Ray worker (pid 116)", "idle Ray worker (pid 117)")


def test_placement_pids(tmp_path):
    assert soak.placement_pids(tmp_path) == {}
    actors = [
        {"role": "trainer", "index": 0},
        {"role": "trainer", "index": 1, "pid": 7},
        {"role": "rollout", "index": 0, "pid": 9},
    ]
    (tmp_path / "placement.json").write_text(json.dumps({"actors": actors}))
    assert soak.placement_pids(tmp_path) == {7: "trainer rank 1", 9: "engine 0"}


def _sample(step, shm, procs):
    return soak.Sample(
        step, shm, {pid: (name, rss, pss, fds) for pid, (name, rss, pss, fds) in procs.items()}
    )


def test_summarize_slopes_warmup_restart_fds_and_shm():
    samples = []
    for step in range(5, 205, 5):
        procs = {
            1: ("driver", 500 * MB, 300 * MB, 42 if step == 120 else 40),  # a file open for a while
            # grows 3 MB per 100 steps, plus a warm-up jump the fit must leave out
            2: ("gcs_server", (50 + (20 if step <= 10 else 0)) * MB + int(0.03 * MB * step), 45 * MB, 64),
        }
        if step < 100:
            procs[3] = ("engine 0", 1800 * MB, 1500 * MB, 98)
        else:  # restarted: a new process, whose first 10 steps are warm-up
            procs[4] = (
                "engine 0",
                (1900 if step <= 110 else 1800) * MB + int(0.01 * MB * step),
                1500 * MB,
                98,
            )
        samples.append(_sample(step, 10 * MB + (MB if step > 150 else 0), procs))
    s = soak.summarize(samples, warmup=10)
    per = {r["pid"]: r for r in s["per_process"]}
    assert s["sampled_steps"] == [15, 200]
    assert per[2]["rss_slope"] == pytest.approx(3.0, abs=1e-3) and per[2]["steps"] == [15, 200]
    assert per[1]["rss_slope"] == pytest.approx(0.0) and per[1]["pss_slope"] == pytest.approx(0.0)
    assert per[4]["steps"] == [115, 200] and per[4]["rss_slope"] == pytest.approx(1.0, abs=1e-3)
    assert (per[3]["role"], per[4]["role"]) == ("engine 0 (pid 3)", "engine 0 (pid 4)")
    assert s["rss_slope_mb_per_100_steps"] == pytest.approx(3.0, abs=1e-3)
    assert s["rss_slope_role"] == "gcs_server"
    assert s["fd_growth"] == 0 and s["fd_start"] == 40 + 64 + 98 and s["fd_max_growth"] == 2
    assert s["end_window_samples"] == 3 and s["fd_growth_first_last"] == 0
    assert per[1]["fds"] == [40, 40] and per[1]["fds_max"] == 42
    assert per[2]["rss_life_mb"] == pytest.approx(0.03 * (190 - 25), abs=0.01)  # medians: steps 25, 190
    assert per[4]["rss_life_mb"] == pytest.approx(0.01 * (190 - 125), abs=0.01) and per[4]["fds_max"] == 98
    assert s["shm_growth_mb"] == pytest.approx(1.0)
    assert "gcs_server" in soak.format_table(s)
    line = json.loads(_common.json_line(s))  # NaN-free, one line
    assert line["pss_slope_role"] in ("driver", "gcs_server", "engine 0")


def test_summarize_without_samples():
    s = soak.summarize([], warmup=10)
    assert s["sampled_steps"] is None and s["fd_growth"] is None and s["rss_slope_role"] is None


def test_step_tail_reads_only_new_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = soak._StepTail(path)
    assert tail.new_steps() == []  # not there yet
    path.write_text('{"step": 1, "a": 0}\n{"step": 2, "a"')
    assert tail.new_steps() == [1]
    with path.open("a") as fh:
        fh.write(': 1}\n{"step": 3}\n')
    assert tail.new_steps() == [2, 3]
    assert tail.new_steps() == []


def test_init_ray_sets_ray_env_for_a_cluster_it_starts(monkeypatch):
    """rl_tpu.cluster.init_ray: Ray's task-event recording (the GCS's per-task history, which grew the GCS
    by ~4.5 MB per 100 soak steps) is off, and Ray's log monitor holds at most 2 log files, in a cluster it
    starts, unless the user set the variable; a cluster it joins is left as it is."""
    import ray

    from rl_tpu import cluster

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    ours = {
        "RAY_task_events_report_interval_ms": "0",
        "RAY_prestart_worker_first_driver": "0",
        "RAY_LOG_MONITOR_MAX_OPEN_FILES": "2",
        "RAY_LOG_MONITOR_NUM_LINES_TO_READ": "100000",
    }
    for var in ours:
        monkeypatch.delenv(var, raising=False)
    assert cluster.init_ray(address="ray://x:1") is True
    assert not any(var in os.environ for var in ours)
    assert cluster.init_ray(num_cpus=1) is True
    assert {var: os.environ.get(var) for var in ours} == ours
    monkeypatch.setenv("RAY_task_events_report_interval_ms", "1000")
    monkeypatch.setenv("RAY_LOG_MONITOR_MAX_OPEN_FILES", "200")
    cluster.init_ray(num_cpus=1)
    assert os.environ["RAY_task_events_report_interval_ms"] == "1000"
    assert os.environ["RAY_LOG_MONITOR_MAX_OPEN_FILES"] == "200"
    assert calls == [{"address": "ray://x:1"}, {"num_cpus": 1}, {"num_cpus": 1}]


def test_fd_and_shm_growth_are_medians_of_the_ends():
    """A count that moves within a bound (Ray's log monitor holds 0-2 worker logs) is no growth; one that
    climbs is, however the single first and last samples fall."""
    steps = range(15, 1000, 5)
    bounded = [
        _sample(st, 10 * MB, {1: ("log monitor", 90 * MB, 50 * MB, 20 + (st // 5) % 3)}) for st in steps
    ]
    s = soak.summarize(bounded, warmup=10)
    assert s["end_window_samples"] == len(steps) // 10
    assert s["fd_growth"] == 0 and s["fd_growth_first_last"] != 0 and s["fd_max_growth"] == 2
    leaking = [  # one fd per 100 steps, and /dev/shm 1 MB per 100 steps
        _sample(st, 10 * MB + st * MB // 100, {1: ("driver", 90 * MB, 50 * MB, 40 + st // 100)})
        for st in steps
    ]
    s = soak.summarize(leaking, warmup=10)
    assert 8 <= s["fd_growth"] <= 10 and 8 <= s["shm_growth_mb"] <= 10


def test_sample_tree_takes_each_process_at_its_floor(monkeypatch, tmp_path):
    """An engine ~10 MB above its floor while it generates: the sample holds the figures read at the
    lowest of its polls, smaps read only when a poll is a new low."""
    polls = {11: iter([1850, 1849, 1840, 1851, 1840]), 10: iter([500] * 5)}
    now: dict[int, int] = {}

    def pages(pid):
        now[pid] = next(polls[pid])
        return now[pid]

    smaps_reads = []

    def memory(pid):
        smaps_reads.append(pid)
        return now[pid] * MB, (now[pid] - 200) * MB

    monkeypatch.setattr(soak, "process_tree", lambda root: [root, 11])
    monkeypatch.setattr(soak, "parent_pid", lambda pid: 1)
    monkeypatch.setattr(soak, "process_cmdline", lambda pid: "ray::RolloutWorker" if pid == 11 else "rl-tpu")
    monkeypatch.setattr(soak, "process_comm", lambda pid: "")
    monkeypatch.setattr(soak, "process_rss_pages", pages)
    monkeypatch.setattr(soak, "process_memory", memory)
    monkeypatch.setattr(soak, "process_fds", lambda pid: 7)
    monkeypatch.setattr(soak, "shm_used_bytes", lambda: 3 * MB)
    s = soak.sample_tree(10, 20, tmp_path, reads=5, spacing_s=0.0)
    assert s.procs[11][1:] == (1840 * MB, 1640 * MB, 7) and s.procs[10][1] == 500 * MB and s.shm == 3 * MB
    assert smaps_reads.count(11) == 3 and smaps_reads.count(10) == 1  # 1850, 1849, 1840; 500 once
    # a process SIGKILLed just before the sample (it dies mid-generation, above its floor) is left out
    polls[10] = iter([500] * 5)
    assert set(soak.sample_tree(10, 25, tmp_path, reads=5, skip=frozenset({11})).procs) == {10}


def test_shm_growth_leaves_out_rays_object_store():
    """Ray's object store touching more of its arena is its own figure; a file of the run growing is
    `shm_growth_mb`."""
    steps = range(15, 1000, 5)
    store = [
        soak.Sample(
            st,
            30 * MB + (MB if st > 500 else 0),
            {1: ("raylet", 30 * MB, 20 * MB, 60)},
            4 * MB + (MB if st > 500 else 0),
        )
        for st in steps
    ]
    s = soak.summarize(store, warmup=10)
    assert s["shm_growth_mb"] == 0 and s["object_store_mb_start"] == 4 and s["object_store_mb_end"] == 5
    files = [
        soak.Sample(st, 30 * MB + (MB if st > 500 else 0), {1: ("raylet", 30 * MB, 20 * MB, 60)}, 4 * MB)
        for st in steps
    ]
    assert soak.summarize(files, warmup=10)["shm_growth_mb"] == 1
