"""The vLLM worker process (worker.py, run by the vLLM environment's python) and the connection to it.

One socket pair, one `multiprocessing.connection.Connection` at each end: plain dicts, no listener and no
address to guard. A reader thread hands every message from the worker to `on_message`; `on_exit` runs
once if the worker goes away without being asked to.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

logger = logging.getLogger("infercept.engine.vllm")

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


class WorkerProcess:
    def __init__(self, python: str, engine_args: dict, env: dict[str, str]):
        self.python = python
        self.engine_args = engine_args
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self._send_lock = threading.Lock()  # the event loop and the shutdown thread both send
        self._stopping = False

    def start(self, timeout: float) -> dict:
        """Launch the worker and wait until vLLM is ready; returns the worker's `info` message.
        RuntimeError if it exits or stays silent for `timeout` seconds (vLLM's own log says why);
        ValueError if it refused its configuration (the worker's reason)."""
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([self.python, WORKER_SCRIPT, str(theirs.fileno()), json.dumps(self.engine_args)],
                                     pass_fds=(theirs.fileno(),), env=os.environ | self.env)
        theirs.close()
        self.conn = Connection(ours.detach())
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                status = self.proc.poll()
                self.stop()
                why = f"exit status {status}" if status is not None else f"not ready after {timeout:.0f} s"
                raise RuntimeError(f"the vLLM worker ({self.python}) did not start: {why} (its log is above)")
        try:
            ready = self.conn.recv()
        except EOFError:
            self.stop()
            raise RuntimeError("the vLLM worker exited while starting (its log is above)") from None
        if ready["op"] == "refused":  # the worker exits by itself
            self._stopping = True
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.conn.close()
            raise ValueError(ready["error"])
        return ready["info"]

    def listen(self, on_message: Callable[[dict], None], on_exit: Callable[[], None]) -> None:
        """Deliver the worker's messages from a reader thread from now on."""
        def read() -> None:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    break
                on_message(msg)
            if not self._stopping:
                logger.error("the vLLM worker exited unexpectedly (status %s)", self.proc.poll())
                on_exit()

        threading.Thread(target=read, name="infercept-vllm-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, msg: dict) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to shut vLLM down; kill it if it does not exit within `timeout`."""
        self._stopping = True
        if self.alive:
            try:
                self.send({"op": "shutdown"})
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                logger.warning("the vLLM worker did not exit within %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        if self.conn is not None:
            self.conn.close()
