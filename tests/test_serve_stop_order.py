"""How jobs.serve stops its private Ray (jobs/_serve_lifecycle.py): the raylet first, then every other
process at once, the reaper last, each group sharing one grace period, so the stop stays within its bound
however many processes the Ray has (Ray's own shutdown gives each process its second in turn). Fake
processes record what was done to them, in order: no Ray, nothing timed."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

from ray._private import ray_constants as rc

from jobs._serve_lifecycle import _terminate_together


class FakeProcess:
    def __init__(self, name: str, log: list, exits_on_term: bool = True):
        self.name, self.log, self.exits_on_term, self.code = name, log, exits_on_term, None

    def poll(self):
        return self.code

    def terminate(self):
        self.log.append(("term", self.name))
        if self.exits_on_term:
            self.code = -15

    def kill(self):
        self.log.append(("kill", self.name))
        self.code = -9

    def wait(self, timeout=None):
        self.log.append(("wait", self.name))
        if self.code is None:
            raise subprocess.TimeoutExpired(self.name, timeout)
        return self.code


def node_of(log: list, stubborn: str = "") -> SimpleNamespace:
    types = [rc.PROCESS_TYPE_REAPER, rc.PROCESS_TYPE_GCS_SERVER, rc.PROCESS_TYPE_RAYLET, rc.PROCESS_TYPE_MONITOR,
             rc.PROCESS_TYPE_LOG_MONITOR, rc.PROCESS_TYPE_DASHBOARD]
    return SimpleNamespace(all_processes={t: [SimpleNamespace(process=FakeProcess(t, log, t != stubborn))]
                                          for t in types})


def test_the_raylet_goes_first_then_the_rest_together_then_the_reaper():
    log: list = []
    node = node_of(log)
    _terminate_together(node, grace_s=0.0)
    assert log[:2] == [("term", rc.PROCESS_TYPE_RAYLET), ("wait", rc.PROCESS_TYPE_RAYLET)]
    middle = log[2:-2]
    others = {rc.PROCESS_TYPE_GCS_SERVER, rc.PROCESS_TYPE_MONITOR, rc.PROCESS_TYPE_LOG_MONITOR,
              rc.PROCESS_TYPE_DASHBOARD}
    terms = [i for i, (what, _) in enumerate(middle) if what == "term"]
    waits = [i for i, (what, _) in enumerate(middle) if what == "wait"]
    assert {n for what, n in middle if what == "term"} == others and max(terms) < min(waits)   # all signalled first
    assert log[-2:] == [("term", rc.PROCESS_TYPE_REAPER), ("wait", rc.PROCESS_TYPE_REAPER)]
    assert node.all_processes == {}


def test_what_does_not_exit_in_its_grace_is_killed_and_reaped():
    log: list = []
    _terminate_together(node_of(log, stubborn=rc.PROCESS_TYPE_GCS_SERVER), grace_s=0.0)
    gcs = [what for what, n in log if n == rc.PROCESS_TYPE_GCS_SERVER]
    assert gcs == ["term", "wait", "kill", "wait"]


def test_the_gcs_ending_in_the_stops_own_shutdown_is_not_a_reason_to_kill(monkeypatch, capsys):
    """stop() cuts the private Ray short when its GCS dies from outside (a process-group signal); the GCS
    ending because this stop's ray.shutdown ended it is the shutdown going well: stop() waits for it."""
    import threading

    import ray

    import actors.cluster.ray_reaper as reaper
    import actors.cluster.ray_start as ray_start
    from jobs import _serve_lifecycle as lifecycle

    gcs_dead = threading.Event()
    swept: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_start, "private_ray", lambda: ("token", "/tmp/none"))
    monkeypatch.setattr(reaper, "sweep", lambda *a: swept.append(a) or [])
    monkeypatch.setattr(lifecycle, "_gcs_alive", lambda: not gcs_dead.is_set())

    def shutdown(app_name, private, since, done, stopping):
        stopping.set()          # what _shutdown_private_ray does before ray.shutdown
        gcs_dead.set()          # ray.shutdown stops the GCS first of what the main loop watches
        threading.Event().wait(0.35)
        done.set()
    monkeypatch.setattr(lifecycle, "_stop_app_and_ray", shutdown)
    assert lifecycle.stop("app", private=True) is True
    assert "did not shut down in time" not in capsys.readouterr().err
    assert swept == [("token", "/tmp/none")]        # whatever is left is still swept, silently
