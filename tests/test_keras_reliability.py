"""Keras 3 / TensorFlow under horovodrun -np 2, what goes wrong: bad arguments, models that differ,
sparse and non-finite gradients, replica drift, a killed or frozen peer, the step watchdog."""
import pytest

from launcher import assert_passed, run_ranks


@pytest.fixture(scope="module")
def reliability_out():
    """One launch for the keras_reliability cases that end normally (TensorFlow starts once)."""
    return run_ranks("mp/keras_reliability.py", "arguments", "sparse", "nonfinite", "drift", timeout=400)


@pytest.mark.multiprocess
def test_keras_bad_arguments_get_errors_that_name_the_problem(reliability_out):
    assert_passed(reliability_out, ["keras-bad-arguments"])


@pytest.mark.multiprocess
def test_keras_models_that_differ_across_ranks_raise_on_every_rank():
    import re

    out = run_ranks("mp/keras_reliability.py", "mismatch", expect_failure=True, timeout=300)
    for rank in (0, 1):
        found = re.search(rf"RAISED rank{rank}: (.*?differ across ranks.*)", out)
        assert found is not None, out[-3000:]
        assert "(12, 33)" in found.group(1) or "(12, 32)" in found.group(1), found.group(1)


@pytest.mark.multiprocess
def test_keras_sparse_embedding_gradients_are_reduced_dense(reliability_out):
    assert_passed(reliability_out, ["keras-sparse-embedding"])


@pytest.mark.multiprocess
def test_keras_nonfinite_gradients_leave_replicas_equal(reliability_out):
    assert_passed(reliability_out, ["keras-nonfinite-int8", "keras-nonfinite-bf16", "keras-nonfinite-none"])


@pytest.mark.multiprocess
def test_keras_replica_drift_is_caught_on_every_rank_in_fit_tf_function_and_eager_loops(reliability_out):
    import re

    out = reliability_out
    assert_passed(out, ["keras-drift-setting-checked-across-ranks"]
                   + [f"keras-drift-checks-pass-while-equal-{loop}" for loop in ("fit", "tf.function", "eager")])
    for loop, error in (("fit", "UnknownError"), ("tf.function", "UnknownError"), ("eager", "ReplicaDriftError")):
        for rank in (0, 1):
            nudged = re.search(rf"NUDGED rank{rank} {re.escape(loop)} ([\w/]+)", out)
            assert nudged is not None, out[-3000:]
            # Rank 1 changed one weight before step 7; the check every 5 steps passed at step 5
            # and fails at step 10, naming that variable, on both ranks.
            name = re.escape(nudged.group(1))
            assert re.search(rf"RAISED rank{rank} {re.escape(loop)} {error}: replicas differ at step 10: parameter "
                             rf"'{name}' on rank\(s\) 1 differs from rank 0 \(they were identical at step 5\)",
                             out), (loop, rank, out[-3000:])


def _run_timed(script: str, *args: str, controller: str, env: dict, timeout: float):
    """Like launcher.run_ranks, but returns (exit status, [(seconds since start, line)]) so a
    test can time what the ranks print, and never fails on a non-zero exit."""
    import os
    import signal
    import subprocess
    import threading
    import time

    from launcher import ROOT, launch_command, rank_env

    cmd = launch_command(script, *args, controller=controller)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=rank_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        raise AssertionError(f"{script} {' '.join(args)}: no result within {timeout:.0f} s (a hang); output:\n"
                             + "\n".join(line for _, line in lines[-100:]))
    reader.join(5)
    return proc.returncode, lines


def _first(lines, pattern: str):
    import re

    for seconds, line in lines:
        if re.search(pattern, line):
            return seconds, line
    raise AssertionError(f"no line matches {pattern!r}; output:\n" + "\n".join(line for _, line in lines[-100:]))


@pytest.mark.multiprocess
def test_keras_killed_peer_under_gloo_is_reported_by_the_survivor_within_seconds():
    """SIGKILL of rank 1 mid model.fit (width 2, int8, Gloo): Horovod sees the broken connection and
    fails the step's collective; model.fit raises on rank 0 (measured: 0.04 s) and the job fails."""
    timeout = 60  # PIPESGD_TIMEOUT: the broken connection is seen long before it
    status, lines = _run_timed("mp/keras_lost_peer.py", "kill", controller="gloo",
                               env={"PIPESGD_TIMEOUT": str(timeout)}, timeout=120)
    output = "\n".join(line for _, line in lines)
    killed, _ = _first(lines, r"rank1 kill at step 15")
    raised, line = _first(lines, r"RAISED rank0 \w+Error at wall clock")
    assert "Horovod has been shut down" in line, line
    assert raised - killed < timeout / 12, (raised - killed, output[-3000:])
    # Not "Process 0 exit with status code 1": horovodrun ends the other ranks once it reaps the
    # killed one, and which of the two it reports first is a race (CI saw no line for rank 0).
    assert status != 0, output[-3000:]


@pytest.mark.multiprocess
def test_keras_frozen_peer_under_mpi_ends_the_survivor_after_pipesgd_timeout():
    """SIGSTOP of rank 1 mid model.fit (alive but silent; MPI never notices, and Horovod's ops in the
    traced step cannot be interrupted): rank 0's step watchdog ends it PIPESGD_TIMEOUT (6 s) after
    its step began waiting, with a PeerLostError line; without the watchdog this run hangs."""
    timeout = 6  # PIPESGD_TIMEOUT
    status, lines = _run_timed("mp/keras_lost_peer.py", "freeze", controller="mpi", timeout=120,
                               env={"PIPESGD_TIMEOUT": str(timeout), "PIPESGD_EXIT_GRACE": "3"})
    output = "\n".join(line for _, line in lines)
    frozen, _ = _first(lines, r"rank1 freeze at step 15")
    ended, line = _first(lines, r"pipesgd_hvd: PeerLostError: a pipelined training step did not complete within "
                                r"6 s \(PIPESGD_TIMEOUT")
    # The watchdog polls every tenth of the timeout and fires on the second look past it.
    assert 0.9 * timeout <= ended - frozen < 1.5 * timeout, (ended - frozen, output[-3000:])
    assert status != 0, output[-3000:]


def test_step_watchdog_ends_a_process_whose_step_is_stuck_and_spares_one_between_steps():
    """The watchdog behind the Keras timeout (pipesgd_hvd.pipeline.guards.StepWatchdog), on fake counters:
    a step begun and never ended ends the process (status 1, PeerLostError line) once the timeout
    passes; a process between steps (begun == ended) may idle past it."""
    import subprocess
    import sys
    import time

    from launcher import ROOT

    timeout = 0.5

    def run(begun_ended: str) -> tuple:
        # the process idles 6 timeouts: long past the watchdog's
        code = ("import time\nfrom pipesgd_hvd.pipeline.guards import StepWatchdog\n"
                f"StepWatchdog(lambda: {begun_ended}, {timeout}, 'a fake step')\ntime.sleep({6 * timeout})\n"
                "print('STILL RUNNING')")
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        return done, time.monotonic() - start

    stuck, seconds = run("(3, 2)")
    assert stuck.returncode == 1 and "STILL RUNNING" not in stuck.stdout, stuck
    assert "PeerLostError: a fake step did not complete within 0.5 s (PIPESGD_TIMEOUT" in stuck.stderr, stuck.stderr
    assert seconds < 5 * timeout, seconds  # the timeout, plus the interpreter's start
    idle, _ = run("(3, 3)")
    assert idle.returncode == 0 and "STILL RUNNING" in idle.stdout, idle
