"""A rollout actor's process ends cleanly when Python exits while its generation loop is inside torch
(actors.rollout_actor.end_at_exit_while_running): Ray's graceful actor exit (the last handle dropped, or the job
ending) finalizes the interpreter, which on its own aborts the process with a native stack trace when the loop's
daemon thread comes back from a torch op (CI's SIGTERM test printed one, from a RolloutWorker, at stop 45).
Real processes and real torch ops; the same program without the hook is the control."""
from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import sys, threading, time
    import torch
    from actors.rollout_actor import end_at_exit_while_running

    torch.set_num_threads(1)
    running = threading.Event()

    def loop():  # like the generation loop: almost all of its time inside torch ops, the GIL released
        p = torch.rand(64, 50_000)
        while True:
            torch.multinomial(p, 1)
            running.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    if sys.argv[1] == "hook":
        end_at_exit_while_running(thread)
    running.wait()
    time.sleep(0.5)
    print("last words", end="")  # buffered: the hook flushes it before ending the process
    sys.exit(0)
""")


def run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)


def test_an_exit_while_the_loop_is_inside_torch_ends_the_process_cleanly():
    control = run("none")
    if sys.version_info < (3, 14):  # from 3.14 such a thread blocks instead of exiting (no abort to show)
        assert control.returncode != 0 and "terminate called" in control.stderr, (control.returncode, control.stderr)
    hooked = run("hook")
    assert hooked.returncode == 0, (hooked.returncode, hooked.stderr)
    assert hooked.stdout == "last words" and "terminate" not in hooked.stderr, (hooked.stdout, hooked.stderr)


def test_an_exit_after_the_loop_ended_is_left_as_it_was():
    """The hook does nothing once the thread has ended: Python's own exit runs (its atexit hooks included)."""
    program = textwrap.dedent("""
        import atexit, sys, threading
        from actors.rollout_actor import end_at_exit_while_running
        atexit.register(lambda: print("python's exit ran"))  # runs after the hook (atexit is last in, first out)
        thread = threading.Thread(target=lambda: None, daemon=True)
        thread.start()
        thread.join()
        end_at_exit_while_running(thread)
        sys.exit(3)
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stdout == "python's exit ran\n", (done.returncode, done.stdout, done.stderr)
