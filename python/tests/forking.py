"""Forks children while another thread of this process is busy, for the tests of locks a fork
inherits (a DataLoader worker forked while a hook or a patch holds one)."""

import os
import sys
import threading
import time
import traceback


def hung_children(child, forks, patience=5.0):
    """Forks `forks` children, each running `child()` and exiting 0; returns how many had not
    exited `patience` seconds later (those are killed). A child that fails fails the caller."""
    hung = 0
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child()
                code = 0
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        deadline = time.monotonic() + patience
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0, status
                break
            if time.monotonic() > deadline:
                hung += 1
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
    return hung


def hung_while(busy, child, forks):
    """Calls `busy()` over and over on another thread (a hook, a patcher) while forking `forks`
    children that each run `child()`: :func:`hung_children` of that."""
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            busy()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        return hung_children(child, forks)
    finally:
        stop.set()
        thread.join()
