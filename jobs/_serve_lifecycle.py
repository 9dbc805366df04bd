"""What ``jobs.serve`` does around the app: check the port, start (or join) Ray off the main thread, turn
SIGINT, SIGTERM and SIGHUP into one clean stop, wait for the front door to route, and stop within ``STOP_S`` of
the signal: drain the app, then the private Ray, then kill whatever of that Ray is left (its processes
carry a mark: actors.cluster.ray_reaper). When the signal went to a whole process group or service (``timeout``,
``kill -TERM -PGID``, systemd's ``KillMode=control-group``), the private Ray's GCS and raylet were
signalled too: there is nothing left to drain through, so the stop skips to that last step."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time

MiB = 1024 ** 2


def connect_ray(address, object_store_mb: int) -> bool:
    """Join the cluster at ``address`` / RAY_ADDRESS, else start a private local Ray; True when private."""
    from actors.cluster.ray_start import init_ray

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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a service manager's stop, a closed terminal
FRONT_DOORS = {"haproxy": "HAProxy", "serve": "Serve's proxy", "cluster's": "the cluster's"}
ROUTE_WAIT_S = 60.0   # seconds the front door (HAProxy or Serve's proxy) may take to route to a started app
STOP_S = 5.0          # documented: a stop signal to the process's exit
DRAIN_S = 3.0         # of which the app's replicas have this long to finish what is in flight
STOP_BY_S = 4.3       # and Ray this long to shut down, before its processes are killed


class Stopper:
    """SIGINT, SIGTERM and SIGHUP all stop the server. Until :meth:`arm` (while Ray starts) a signal is only
    recorded, so that Ray is never left half-started; after it, a signal raises KeyboardInterrupt in the
    main thread; during the stop itself further signals are ignored, so a second Ctrl-C cannot cut it.
    :attr:`since`: when the first signal came (time.monotonic), None before."""

    def __init__(self):
        self.requested, self.since = False, None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._hold)

    def _note(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def _hold(self, signum, frame) -> None:
        self._note()
        self.requested = True

    def _interrupt(self, signum, frame) -> None:
        self._note()
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


def check_port(host: str, port: int) -> None:
    """ValueError naming the flag when ``port`` is not one, or when ``host:port`` cannot be listened on
    (something listens there already, or the host is not this machine's), before anything starts."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {port!r}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:     # socket.gaierror: not an address, nor a name this machine resolves
        raise ValueError(f"--host {host}: not an address or a name this machine resolves ({e.strerror or e})") from None
    family, _, _, _, addr = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {host}: not an address of this machine; use one of its own (or 0.0.0.0 "
                             "for all)") from None
        what = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be listened on ({e.strerror or e})"
        raise ValueError(f"--port {port}: {host}:{port} {what}; stop what listens there or pick another "
                         "--port") from None


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


def _gcs_alive() -> bool:
    """Whether the GCS of the private Ray started here still runs (True when unknown)."""
    try:
        from ray._private import ray_constants, worker

        node = worker._global_node
        procs = node.all_processes.get(ray_constants.PROCESS_TYPE_GCS_SERVER) if node is not None else None
        return not procs or procs[0].process.poll() is None
    except Exception:  # noqa: BLE001 - Ray's internals moved: assume it runs (the stop is bounded anyway)
        return True


GRACE_S = 1.0        # each group of the private Ray's processes (raylet; the rest; the reaper) to exit on SIGTERM


def _terminate_together(node, grace_s: float = GRACE_S) -> None:
    """Stop the private Ray's processes as Ray's ``Node.kill_all_processes`` does (SIGTERM, then SIGKILL for
    what did not exit), but the raylet first and then every other process at once, each group given
    ``grace_s`` together: Ray's own gives each process its second in turn, which is seconds past the
    documented stop time with the reaper, GCS, monitor, log monitor and dashboard to go."""
    import subprocess

    from ray._private import ray_constants as rc

    procs = node.all_processes
    others = [t for t in procs if t not in (rc.PROCESS_TYPE_RAYLET, rc.PROCESS_TYPE_REAPER)]
    for types in ([rc.PROCESS_TYPE_RAYLET], others, [rc.PROCESS_TYPE_REAPER]):
        group = [info.process for t in types for info in procs.get(t, ()) if info.process.poll() is None]
        for p in group:
            p.terminate()
        end = time.monotonic() + grace_s
        for p in group:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=grace_s)   # reaped, unless stuck in the kernel (the sweep then reports it)
        for t in types:
            procs.pop(t, None)


def _shutdown_private_ray(stopping: threading.Event) -> None:
    """ray.shutdown with the private Ray's processes stopped together (:func:`_terminate_together`); Ray's
    own way where its internals are not as expected. ``stopping`` is set first: from then on the GCS
    exits because this stop ends it, not because something else did."""
    import ray

    stopping.set()

    try:
        from ray._private import worker

        node = worker._global_node
        if node is not None and isinstance(getattr(node, "all_processes", None), dict):
            node.kill_all_processes = lambda *a, **k: _terminate_together(node)
    except Exception:  # noqa: BLE001 - Ray's internals moved: its own shutdown, bounded by stop() anyway
        pass
    ray.shutdown(wait_for_processes=True)


def _stop_app_and_ray(app_name: str, private: bool, since: float, done: threading.Event,
                      stopping: threading.Event) -> None:
    import ray
    from ray import serve

    try:  # open streams end now with an error event and [DONE] (every replica also does it when stopped)
        serve.get_deployment_handle("OpenAIIngress", app_name).drain.remote().result(timeout_s=1.0)
    except Exception:  # noqa: BLE001 - no app yet, or it cannot answer: the deletion below still drains
        pass
    try:
        serve.delete(app_name, _blocking=False)
        while private and app_name in serve.status().applications and time.monotonic() < since + DRAIN_S:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - no Serve yet (stopped during start-up), Ray going away: nothing to drain
        pass
    if private:
        _shutdown_private_ray(stopping)
    else:
        ray.shutdown()
    done.set()


def stop(app_name: str, private: bool, since: float | None = None) -> bool:
    """Delete the app: Serve drains each replica (what is in flight is answered or ends; the replicas'
    shutdown hooks run). On a private Ray, wait for that until DRAIN_S after ``since`` (the signal; default
    now), then stop the Ray; on a joined cluster only disconnect (its controller finishes the deletion).
    Whatever has not finished STOP_BY_S after ``since`` is cut short: every process of the private Ray
    still running is killed. True when Ray shut down in time; False: the caller must leave at once
    (os._exit), as Ray may still hold this process."""
    import ray

    from actors.cluster.ray_reaper import sweep
    from actors.cluster.ray_start import private_ray

    if not ray.is_initialized():
        return True
    since = time.monotonic() if since is None else since
    done, stopping = threading.Event(), threading.Event()
    mark = private_ray() if private else None
    if mark is not None and not _gcs_alive():   # signalled with this process: nothing left to drain through
        killed = sweep(*mark)
        print(f"stop: the private Ray's GCS had stopped already (signalled with this process); killed its "
              f"{len(killed)} remaining processes", file=sys.stderr, flush=True)
        return False
    threading.Thread(target=_stop_app_and_ray, args=(app_name, private, since, done, stopping), name="stop",
                     daemon=True).start()
    while not done.wait(0.1) and time.monotonic() < since + STOP_BY_S:
        if mark is not None and not stopping.is_set() and not _gcs_alive():   # gone after the signal, and
            # not by this stop's own shutdown: nothing will answer
            break
    if mark is not None:
        killed = sweep(*mark)
        if not done.is_set():
            print(f"stop: the private Ray did not shut down in time (its GCS was signalled too, or it took "
                  f"over {STOP_BY_S:g} s); killed its {len(killed)} remaining processes", file=sys.stderr, flush=True)
    return done.is_set()
