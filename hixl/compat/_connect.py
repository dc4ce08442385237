"""``connect_async``/``disconnect_async``: hixl's connect pool, on worker threads.

This follows hixl's ``ConnectPoolExecutor`` (hicann/hixl
``src/hixl/engine/connect_pool_executor.cc``): a bounded task queue
(``connect_pool.task_queue_capacity``, default 128; a full queue gives
RESOURCE_EXHAUSTED) served by ``connect_pool.thread_num`` workers (default 2),
at most one task per remote engine at a time, and a status table per remote:

* submit: CONNECT_PENDING or DISCONNECT_PENDING;
* a worker takes it: CONNECTING or DISCONNECTING;
* it ends: CONNECTED or CONNECT_FAILED; a disconnect removes the entry,
  which reads as NOT_CONNECT.

The table always shows the caller's latest request: a connect's result does
not overwrite a DISCONNECT_PENDING submitted meanwhile, nor a disconnect's a
CONNECT_PENDING.  The caller never waits for a link: submitting only takes
the lock.  Workers start on first use and stop at :meth:`shutdown`.

Lock: ``_cond`` guards the queue, the set of remotes being worked on and the
status table.  The connect/disconnect itself runs outside it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hixl.compat._types import AsyncConnectStatus, Status

__all__ = ["ConnectExecutor"]

log = logging.getLogger("hixl.compat")


@dataclass(slots=True)
class _Task:
    remote: str
    is_connect: bool
    run: Callable[[], Status]


class ConnectExecutor:
    """Runs connect/disconnect tasks on ``threads`` workers; at most ``capacity`` queued."""

    def __init__(self, threads: int, capacity: int, name: str = "hixl-compat-connect") -> None:
        self._threads = threads
        self._capacity = capacity
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[_Task] = deque()
        self._doing: set[str] = set()
        self._status: dict[str, AsyncConnectStatus] = {}
        self._workers: list[threading.Thread] = []
        self._open = True

    def submit(self, remote: str, is_connect: bool, run: Callable[[], Status]) -> Status:
        """Queue ``run`` for ``remote``; SUCCESS, RESOURCE_EXHAUSTED when full, FAILED when shut."""
        with self._cond:
            if not self._open:
                return Status.FAILED
            if len(self._queue) >= self._capacity:
                log.warning("connect pool queue is full (%d tasks)", self._capacity)
                return Status.RESOURCE_EXHAUSTED
            pending = (
                AsyncConnectStatus.CONNECT_PENDING
                if is_connect
                else AsyncConnectStatus.DISCONNECT_PENDING
            )
            self._set(remote, pending)
            self._queue.append(_Task(remote, is_connect, run))
            if len(self._workers) < self._threads:
                worker = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._workers)}", daemon=True
                )
                self._workers.append(worker)
                worker.start()
            self._cond.notify()
            return Status.SUCCESS

    def status(self, remote: str) -> AsyncConnectStatus:
        with self._cond:
            return self._status.get(remote, AsyncConnectStatus.NOT_CONNECT)

    def statuses(self) -> dict[str, AsyncConnectStatus]:
        with self._cond:
            return dict(self._status)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking tasks, drop queued ones, wait up to ``timeout`` s for running ones."""
        with self._cond:
            self._open = False
            self._queue.clear()
            workers, self._workers = self._workers, []
            self._cond.notify_all()
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join(timeout)

    def _set(self, remote: str, status: AsyncConnectStatus) -> None:
        """Record ``status`` unless the caller asked for the opposite since (lock held)."""
        current = self._status.get(remote)
        if (
            status
            in (
                AsyncConnectStatus.CONNECTING,
                AsyncConnectStatus.CONNECTED,
                AsyncConnectStatus.CONNECT_FAILED,
            )
            and current is AsyncConnectStatus.DISCONNECT_PENDING
        ):
            return
        if (
            status in (AsyncConnectStatus.DISCONNECTING, AsyncConnectStatus.NOT_CONNECT)
            and current is AsyncConnectStatus.CONNECT_PENDING
        ):
            return
        if status is AsyncConnectStatus.NOT_CONNECT:
            self._status.pop(remote, None)
        else:
            self._status[remote] = status

    def _next(self) -> _Task | None:
        """The oldest task whose remote nobody is working on; None when shut down."""
        with self._cond:
            while True:
                if not self._open:
                    return None
                for task in self._queue:
                    if task.remote not in self._doing:
                        self._queue.remove(task)
                        self._doing.add(task.remote)
                        self._set(
                            task.remote,
                            AsyncConnectStatus.CONNECTING
                            if task.is_connect
                            else AsyncConnectStatus.DISCONNECTING,
                        )
                        return task
                self._cond.wait()

    def _work(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            try:
                code = task.run()
            except Exception as exc:  # noqa: BLE001 - a task must never kill its worker
                log.error("async %s of %s raised %r", task, task.remote, exc, exc_info=exc)
                code = Status.FAILED
            if task.is_connect:
                ok = code in (Status.SUCCESS, Status.ALREADY_CONNECTED)
                result = AsyncConnectStatus.CONNECTED if ok else AsyncConnectStatus.CONNECT_FAILED
            else:
                result = AsyncConnectStatus.NOT_CONNECT
            with self._cond:
                self._set(task.remote, result)
                self._doing.discard(task.remote)
                self._cond.notify_all()
