"""User code with a time limit: the one seam through which the actors call code a user configured, where a call
that never returns can be abandoned. Reward functions (actors/tasks/reward.py, `actors.reward.timeout_s`) and task
generators (actors/tasks/data.py, `actors.data.timeout_s`) run through `UserCode`; the environment steps of multi-turn
rollouts are meant to run through it too when they land (one `UserCode` per environment function, called per step).

Why a process: a Python thread cannot be stopped, so a function that never returns (`while True: pass`, a regex
that backtracks forever, a sympy simplification that does not end) would hold its thread and a CPU core for the
life of the actor. `UserCode` runs the function in a worker process instead: one worker, started on the first
call and reused by every later one (a call costs one round trip over a socket pair, the arguments and the result
pickled; no process per call), killed with SIGKILL when a call outlives `timeout_s`, and replaced on the next
call. The calling process keeps no thread for it and waits in `poll` (no CPU), so after a timeout its threads and
CPU use are what they were before.

The worker is `sys.executable -c ...` with the caller's `sys.path` (it imports the code the caller imports: the
installed packages, a user's PYTHONPATH; never the caller's `__main__`, as multiprocessing's spawn would), its
stdout and stderr are the caller's, it ignores SIGINT (Ctrl-C is the caller's to handle) and it exits within a
second once the caller's process is gone (a watchdog thread), also while it runs a function that never returns.
"""
from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import weakref
from multiprocessing.connection import Connection
from typing import Any, Sequence

START_TIMEOUT_S = 120.0
"""Longest a worker may take to start (interpreter, `preload` and the function's module imported), seconds; not
counted in a call's timeout."""

_BOOT = "import sys; sys.path[:] = sys.argv[1].split('\\n'); from actors.user_code import _serve; _serve(*sys.argv[2:])"


class UserCodeTimeout(TimeoutError):
    """A call that did not return within its timeout; its worker was killed (the next call starts a new one).
    `name`: what timed out (e.g. "reward function my_task:reward"), `timeout_s`, `setting`: the config field."""

    def __init__(self, name: str, timeout_s: float, setting: str = ""):
        self.name, self.timeout_s, self.setting = name, timeout_s, setting
        super().__init__(f"{name} did not return within {timeout_s:g} s" + (f" ({setting})" if setting else ""))


class UserCodeError(RuntimeError):
    """The function raised in the worker (`kind`: its exception's type name, `message`: its text), its result
    could not be sent back, or the worker could not start or died; str() is "<kind>: <message>"."""

    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message
        super().__init__(f"{kind}: {message}")


class _Worker:
    """One worker process and the caller's end of its socket pair."""

    def __init__(self, spec: str, preload: Sequence[str], start_timeout_s: float):
        mine, theirs = socket.socketpair()
        argv = [sys.executable, "-c", _BOOT, "\n".join(sys.path), str(theirs.fileno()), spec, ",".join(preload),
                str(os.getpid())]
        try:
            self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        if not self.conn.poll(start_timeout_s):
            self.stop()
            raise UserCodeError("TimeoutError", f"its worker process did not start within {start_timeout_s:g} s")
        try:
            reply = self.conn.recv()
        except EOFError:
            self.stop()
            raise UserCodeError("WorkerDied", f"its worker process exited while starting (exit code "
                                              f"{self.proc.returncode})") from None
        if reply[0] != "ready":
            self.stop()
            raise UserCodeError(reply[1], reply[2])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGKILL the worker (whatever it is running) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # in the kernel (uninterruptible I/O): it ends when that does
            pass
        self.conn.close()


def _stop(box: list) -> None:
    """Stop the worker in `box` (weakref.finalize of a UserCode, and UserCode.close)."""
    worker, box[0] = box[0], None
    if worker is not None:
        worker.stop()


class UserCode:
    """The callable `spec` ("package.module:function") called with a time limit, in a worker process that can be
    abandoned: `UserCode(spec, timeout_s)(*args, **kwargs)` returns what the function returns.

    Raises UserCodeTimeout when a call takes longer than `timeout_s` seconds (the worker is killed; the next call
    starts a fresh one, START_TIMEOUT_S at most, not counted in its timeout), UserCodeError when the function
    raised (its type name and message; the worker goes on) or the worker could not start or died, and pickling
    errors of the arguments as they are. The arguments and the result must pickle (a generator's items come back
    as a list, consumed within the call's time); what they reference must be
    importable in the worker: `preload` names modules the worker imports before its first call (e.g.
    "actors.tasks.data" for an `actors.tasks.data.Prompt` argument), so that importing them is not counted in a
    call's time.
    `timeout_s` 0: no limit, the function is called in this process (as plain code; a call that never returns
    holds its thread). Calls are serialized (one at a time, from any thread); `timeouts` counts the calls that
    timed out. The worker is stopped by `close()`, when the UserCode is garbage-collected, and at exit.

    This is the seam for all user code the actors run: reward functions, task generators, and later the
    environment steps of multi-turn rollouts."""

    def __init__(self, spec: str, timeout_s: float, *, name: str = "", setting: str = "",
                 preload: Sequence[str] = (), start_timeout_s: float = START_TIMEOUT_S):
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"{spec!r}: expected 'package.module:function'")
        self.spec, self.timeout_s, self.name, self.setting = spec, float(timeout_s), name or spec, setting
        self.preload, self.start_timeout_s = tuple(preload), start_timeout_s
        self.timeouts = 0
        self._fn = None  # timeout_s 0: the function itself, loaded on the first call
        self._lock = threading.Lock()
        self._box: list[_Worker | None] = [None]
        self._finalizer = weakref.finalize(self, _stop, self._box)

    @property
    def pid(self) -> int | None:
        """The worker's process id (None before the first call, after a timeout and without a limit)."""
        worker = self._box[0]
        return worker.proc.pid if worker is not None and worker.alive else None

    def __call__(self, *args, **kwargs) -> Any:
        if self.timeout_s <= 0:
            if self._fn is None:
                module, _, attr = self.spec.partition(":")
                self._fn = getattr(importlib.import_module(module), attr)
            return self._fn(*args, **kwargs)
        with self._lock:
            worker = self._box[0]
            if worker is None or not worker.alive:
                _stop(self._box)
                worker = self._box[0] = _Worker(self.spec, self.preload, self.start_timeout_s)
            try:
                worker.conn.send((args, kwargs))  # pickled whole before a byte is sent: a pickling error sends nothing
            except OSError as e:  # the worker died between two calls
                _stop(self._box)
                raise UserCodeError("WorkerDied", f"its worker process is gone ({e})") from None
            if not worker.conn.poll(self.timeout_s):
                _stop(self._box)
                self.timeouts += 1
                raise UserCodeTimeout(self.name, self.timeout_s, self.setting)
            try:
                reply = worker.conn.recv()
            except EOFError:
                _stop(self._box)
                raise UserCodeError("WorkerDied", f"its worker process died during the call (exit code "
                                                  f"{worker.proc.returncode})") from None
            except Exception as e:  # the result does not unpickle here
                raise UserCodeError(type(e).__name__, f"its result cannot be received ({e})") from None
        if reply[0] == "ok":
            return reply[1]
        raise UserCodeError(reply[1], reply[2])

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            _stop(self._box)

    def __enter__(self) -> "UserCode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def call_with_timeout(spec: str, timeout_s: float, *args, name: str = "", setting: str = "", **kwargs) -> Any:
    """One call of `spec` in its own worker, which is stopped afterwards (see UserCode): for code called once,
    e.g. a task generator at start."""
    with UserCode(spec, timeout_s, name=name, setting=setting) as code:
        return code(*args, **kwargs)


# -- the worker process ------------------------------------------------------------------------------------------
def _exit_when_orphaned(parent: int) -> None:
    """The worker's watchdog: exit once the caller's process is gone (this process is re-parented)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _serve(fd: str, spec: str, preload: str, parent: str) -> None:
    """The worker's main loop: import `preload` and the function, say ready, then answer one call at a time on the
    socket `fd` with ("ok", value) or ("raised", type name, message) until the caller closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(int(parent),), name="user-code-watchdog", daemon=True).start()
    conn = Connection(int(fd))
    try:
        for name in filter(None, preload.split(",")):
            importlib.import_module(name)
        module, _, attr = spec.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    except BaseException as e:  # reported to the caller, which raises it as UserCodeError
        conn.send(("raised", type(e).__name__, f"cannot load {spec} in the worker process ({e})"))
        return
    conn.send(("ready",))
    while True:
        try:
            args, kwargs = conn.recv()
        except EOFError:  # the caller closed its end (close(), or its process ended)
            return
        except Exception as e:  # the arguments do not unpickle here (the message was read whole: in step)
            conn.send(("raised", type(e).__name__, f"its arguments cannot be received in the worker ({e})"))
            continue
        try:
            value = fn(*args, **kwargs)
            reply = ("ok", list(value) if isinstance(value, types.GeneratorType) else value)  # a `yield`ing function
        except BaseException as e:  # SystemExit included: the worker answers and goes on
            reply = ("raised", type(e).__name__, str(e))
        try:
            conn.send(reply)
        except Exception as e:  # the result does not pickle (nothing was sent)
            conn.send(("raised", type(e).__name__, f"its result cannot be sent back ({e})"))
