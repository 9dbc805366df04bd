"""What ``jobs.serve`` does around the app: start (or join) Ray off the main thread, turn SIGINT and SIGTERM
into one clean stop, wait for the front door to route, and stop: drain the app, then the private Ray."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

MiB = 1024 ** 2


def connect_ray(address, object_store_mb: int) -> bool:
    """Join the cluster at ``address`` / RAY_ADDRESS, else start a private local Ray; True when private."""
    from actors.ray_start import init_ray

    return init_ray(address, num_cpus=max(2, os.cpu_count() or 1), object_store_memory=object_store_mb * MiB,
                    log=lambda m: print(m, file=sys.stderr, flush=True), logging_level="ERROR")


EXISTING_SERVE = "Connecting to existing Serve app"


@contextlib.contextmanager
def dropped_log_line(logger: str, text: str):
    """Within the block, ``logger`` drops records whose message contains ``text``."""
    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return text not in record.getMessage()

    f, log = Drop(), logging.getLogger(logger)
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)


class RayOwner(threading.Thread):
    """Starts Ray (connect_ray) off the main thread and stays alive until :meth:`release`. Off the main
    thread, ray.init keeps our SIGTERM handler (from the main thread it installs its own, a sys.exit that a
    start-up in progress may swallow); staying alive matters because Linux kills the processes ray.init
    starts when the *thread* that started them ends (their parent-death signal)."""

    def __init__(self, address, object_store_mb: int):
        super().__init__(name="ray-owner", daemon=True)
        self.args, self.private, self.error = (address, object_store_mb), False, None
        self.ready, self.released = threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            self.private = connect_ray(*self.args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            self.error = e
        finally:
            self.ready.set()
        self.released.wait()

    def start_ray(self) -> bool:
        """Start, wait (signals are handled meanwhile), re-raise its error; True when the Ray is private."""
        with dropped_log_line("ray._private.worker", "SIGTERM handler is not set"):
            self.start()
            while not self.ready.wait(0.1):
                pass
        if self.error is not None:
            raise self.error
        return self.private

    def release(self) -> None:
        self.released.set()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, or a service manager's stop: the same path
FRONT_DOORS = {"haproxy": "HAProxy", "serve": "Serve's proxy", "cluster's": "the cluster's"}
ROUTE_WAIT_S = 60.0   # seconds the HAProxy front door may take to route to a started app
DRAIN_S = 3.0   # seconds a stop gives the app's replicas to finish what is in flight before Ray goes


class Stopper:
    """SIGINT and SIGTERM both stop the server. Until :meth:`arm` (while Ray starts) a signal is only
    recorded, so that Ray is never left half-started; after it, a signal raises KeyboardInterrupt in the
    main thread; during the stop itself further signals are ignored, so a second Ctrl-C cannot cut it."""

    def __init__(self):
        self.requested = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._hold)

    def _hold(self, signum, frame) -> None:
        self.requested = True

    @staticmethod
    def _interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    def arm(self) -> None:
        """From now on a signal interrupts; one that came while held interrupts now."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._interrupt)
        if self.requested:
            raise KeyboardInterrupt

    def disarm(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def wait_answering(url: str, timeout_s: float = ROUTE_WAIT_S) -> None:
    """Until ``url`` answers with any HTTP status (401 without the key counts), at most ``timeout_s``."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except urllib.error.HTTPError as e:
            if e.code != 404 and e.code < 500:    # 404 / 503: HAProxy has no route to the app yet
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            print(f"warning: {url} did not answer within {timeout_s:.0f} s of the app's start", file=sys.stderr)
            return
        time.sleep(0.2)


def stop(app_name: str, private: bool) -> None:
    """Delete the app: Serve drains each replica (what is in flight is answered or ends; the replicas'
    shutdown hooks run). On a private Ray, wait for that at most DRAIN_S, then stop the Ray and wait for
    all its processes; on a joined cluster only disconnect (its controller finishes the deletion)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    deadline = time.monotonic() + DRAIN_S
    try:  # open streams end now with an error event and [DONE] (every replica also does it when stopped)
        serve.get_deployment_handle("OpenAIIngress", app_name).drain.remote().result(timeout_s=1.0)
    except Exception:  # noqa: BLE001 - no app yet, or it cannot answer: the deletion below still drains
        pass
    try:
        serve.delete(app_name, _blocking=False)
        while private and app_name in serve.status().applications and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - no Serve yet (stopped during start-up), Ray going away: nothing to drain
        pass
    ray.shutdown(wait_for_processes=private)
