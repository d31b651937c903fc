"""How a dead actor is reported: Ray's actor-death text cut to its facts, the dead worker's log named, and
the crash line and frame read from it (rl_tpu/cluster.py `actor_death_summary`). No Ray: the texts are
Ray's and a real crash's."""

from __future__ import annotations

import subprocess
import sys

RAY_DEATH = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutWorker\n\tactor_id: 31d0\n"
    "\tpid: 23972\n\tnamespace: 78f7\n\tip: 192.0.2.2\nThe actor is dead because its worker process has died. "
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error "
    "code 2. End of file. Some common causes include: (1) the process was killed by the OOM killer due to "
    "high memory usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly due to "
    "SIGSEGV or another unexpected error. If the process was killed by the kernel OOM killer (verifiable "
    "by checking for OOM in dmesg of the OOMing node), consider enabling resource isolation."
)


def test_actor_death_summary_is_short_and_names_the_workers_log_and_crash(tmp_path):
    """Ray's ~900-character actor-death text is cut to its facts; the dead worker's log and the crash
    line in it (which Ray's text never says) are named when the log is on this node."""
    from rl_tpu.cluster import actor_death_summary

    log = tmp_path / "worker-60a9-01000000-23972.err"
    log.write_text(
        ":actor_name:RolloutWorker\nLoading weights\n\n*** SIGILL received at time=1796400424 on cpu 0 ***\n"
        "PC: @ 0x7fb3 cpu_attention::AttentionMainLoop<>::operator()()\n"
        "Fatal Python error: Illegal instruction\n\nExtension modules: msgpack\n"
    )
    (tmp_path / "worker-60a9-01000000-23973.err").write_text("another worker's log\n")
    short = actor_death_summary(RuntimeError(RAY_DEATH), str(tmp_path))
    assert short.startswith(
        "The actor died unexpectedly before finishing this task. The actor is dead because"
    )
    assert (
        "Worker exit type: SYSTEM_ERROR" in short
        and "(out of memory, `ray stop --force` or a crash)" in short
    )
    assert "OOM killer" not in short and "actor_id" not in short
    assert short.endswith(f"; its log: {log} (Fatal Python error: Illegal instruction)"), short
    assert len(short) < len(RAY_DEATH)
    # no log on this node (a remote worker, or Ray's logs elsewhere): the short text alone
    assert actor_death_summary(RuntimeError(RAY_DEATH), str(tmp_path / "none")).endswith("or a crash)")


def test_a_dead_trainer_rank_gets_the_same_short_message():
    from rl_tpu.trainer.group import TrainerError

    ActorDiedError = type("ActorDiedError", (Exception,), {})  # Ray's class name is what TrainerError reads
    msg = str(TrainerError(1, "train_step", ActorDiedError(RAY_DEATH)))
    assert msg.startswith("trainer rank 1 died in train_step(): The actor died unexpectedly before finishing")
    assert "OOM killer" not in msg and "actor_id" not in msg and "or a crash)" in msg
    assert str(TrainerError(0, "ready", ValueError("bad"))) == "trainer rank 0 failed in ready(): bad"


CRASHER = """
import ctypes, faulthandler, sys
faulthandler.enable(sys.stderr)

def gather_weights():
    ctypes.string_at(0)  # a read of address 0 inside a library call, as a segfault in a C extension

gather_weights()
"""


def test_a_real_segfault_is_named_with_where_it_happened(tmp_path):
    """A process that really segfaults with faulthandler on (as Ray's workers run): the summary names the
    fatal error, the innermost frame (the library call) and the innermost frame outside the libraries."""
    from rl_tpu.cluster import actor_death_summary

    script = tmp_path / "trainer_step.py"
    script.write_text(CRASHER)
    log = tmp_path / "worker-60a9-01000000-23972.err"
    with open(log, "w") as err:
        r = subprocess.run([sys.executable, str(script)], stderr=err, timeout=60)
    assert r.returncode != 0
    short = actor_death_summary(RuntimeError(RAY_DEATH), str(tmp_path))
    crash = short.split(f"; its log: {log} (", 1)[1]
    assert crash.startswith("Fatal Python error: Segmentation fault in string_at() at "), crash
    line = next(i for i, text in enumerate(CRASHER.splitlines(), 1) if "string_at(0)" in text)
    assert "ctypes" in crash and crash.endswith(f", called from gather_weights() at {script}:{line})"), crash


def test_a_crash_line_without_a_python_stack_is_named_alone(tmp_path):
    from rl_tpu.cluster import actor_death_summary

    log = tmp_path / "worker-60a9-01000000-23972.err"
    log.write_text("*** SIGSEGV received at time=1 on cpu 0 ***\nPC: @ 0x7fb3 (unknown)\n")
    assert actor_death_summary(RuntimeError(RAY_DEATH), str(tmp_path)).endswith("(*** SIGSEGV received)")
