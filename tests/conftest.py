"""Shared fixtures. ``s3``: one real SeaweedFS S3 server per test session (see tests/s3server.py).
``ray_cluster``: one simulated multi-node Ray cluster per session (``ray.cluster_utils.Cluster``: a head
without CPUs, so that every actor runs on a worker node, and three worker nodes of 2 CPUs, with fast
node-death detection), this process connected as the driver; stopped at the end of the session.
``torch_one_thread_by_default``: one torch thread here and OMP_NUM_THREADS=1 in every process a test starts,
so that no thread spin-waits for another when other work keeps the 2 cores busy.

The fast tier, ``pytest -m "not slow"``, starts no Ray, no Serve and no server: every test that uses the
``ray_cluster`` or ``s3`` fixture, or sits in a module (or is a test) that starts one itself
(STARTS_SERVERS), is marked ``slow`` here, and so is every test listed in tests/slow_for_time.txt (those
over 1.5 s in a fast-tier run: scripts/slow_tests.py keeps the list).

The modules run in their file order, but those that use the ``ray_cluster`` fixture come after all the
others, and those that use Serve (the ``serve_http`` fixture) last: the cluster (GCS, raylets, agents:
~8% of a core while idle) and Serve (another ~5%) then run only while they are used, not beside every
test after the first that started them.

On two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadscope``), the modules that start a
server run on one worker in that order, and the other modules, whole, on whichever worker is free
(``order_for_two_workers``, ``pytest_xdist_make_scheduler``); the session fixtures that write a model
(``embedded_quantized``, ``tiny_quantized``) are made once for both workers (``made_once``)."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

import s3server
from environ import environment
from pipeline.io import storage


#: Fixtures that start Ray or a server, and the modules and tests that start them themselves.
SERVER_FIXTURES = frozenset(("ray_cluster", "s3"))
STARTS_SERVERS = frozenset((
    "test_private_ray.py",              # private Ray heads
    "test_serve_shutdown.py",           # python -m jobs.serve
    "test_serve_slowloris.py",          # uvicorn, then jobs.serve
    "test_serve_hardening.py::test_proxy_guard_cleans_request_ids_and_keys_the_routes",   # uvicorn
))


#: Tests slow for their time (module::function, or a whole module whose fixture is the cost), kept by
#: scripts/slow_tests.py.
SLOW_FOR_TIME = frozenset(s for line in (Path(__file__).parent / "slow_for_time.txt").read_text().splitlines()
                          if (s := line.split("#")[0].strip()))


#: Under pytest-xdist (pyproject's addopts: ``-n 2 --dist loadscope``), the one unit of work of every module
#: with a test that starts Ray, Serve, a server or a torch.distributed group: one worker runs them one after
#: another (one session cluster; no two of them at once contending for ports and memory).
SERVERS = "servers"
#: Where the workers tell the controller which modules those are (in the run's temporary directory).
SERVER_MODULES_FILE = "server-modules.json"


def starts_servers(item) -> bool:
    module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
    test = f"{module}::{item.name.split('[')[0]}"
    return bool(SERVER_FIXTURES & set(item.fixturenames)) or module in STARTS_SERVERS or test in STARTS_SERVERS


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        test = f"{module}::{item.name.split('[')[0]}"
        if starts_servers(item) or test in SLOW_FOR_TIME or module in SLOW_FOR_TIME:
            item.add_marker(pytest.mark.slow)
    order = {}   # module -> 0 (no Ray), 1 (the session's Ray cluster), 2 (Serve on it)
    for item in items:
        uses = set(item.fixturenames)
        group = 2 if "serve_http" in uses else 1 if "ray_cluster" in uses else 0
        order[getattr(item, "module", None)] = max(order.get(getattr(item, "module", None), 0), group)
    items.sort(key=lambda item: order[getattr(item, "module", None)])  # stable: file order within each group
    if "PYTEST_XDIST_WORKER" in os.environ:
        order_for_two_workers(config, items)


def order_for_two_workers(config, items) -> None:
    """On a pytest-xdist worker: the modules that start servers first (ServersApart makes them one unit of
    work), then the others, those with the most slow tests (the long ones) first and the short ones last,
    to even out the two workers' ends (loadscope hands the units out in the order of their first test, with
    ``--no-loadscope-reorder``); and those modules written down for the controller's ServersApart."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    servers = sorted(m for m, its in modules.items() if any(starts_servers(i) for i in its))
    rank = {m: (0, 0) if m in servers else (1, -sum(i.get_closest_marker("slow") is not None for i in its))
            for m, its in modules.items()}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: the order above within each
    if not config.option.basetemp:   # xdist gives each worker one, <the run's>/popen-gwN, but with no tmpdir
        return
    run_dir = Path(config.option.basetemp).parent
    mine = run_dir / f"{SERVER_MODULES_FILE}.{os.environ['PYTEST_XDIST_WORKER']}"
    mine.write_text(json.dumps(servers))
    mine.replace(run_dir / SERVER_MODULES_FILE)   # both workers write the same list; each write whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the server modules one scope (ServersApart)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ServersApart(LoadScopeScheduling):
        """loadscope's units (a test module each, run on one worker: its module fixtures made once), but the
        modules the workers wrote down as starting servers (order_for_two_workers) are one unit together."""

        servers: frozenset = None

        def _split_scope(self, nodeid: str) -> str:
            if self.servers is None:   # first asked once every worker has collected (and so written the list)
                listed = config._tmp_path_factory.getbasetemp() / SERVER_MODULES_FILE   # as xdist finds it
                self.servers = frozenset(json.loads(listed.read_text()) if listed.exists() else ())
            module = nodeid.split("::")[0]
            return SERVERS if module in self.servers else super()._split_scope(nodeid)

    return ServersApart(config, log)


@dataclass
class S3:
    """What the ``s3`` fixture yields: the running server, and fresh buckets on it."""

    server: s3server.S3Server

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def bucket(self, name: str) -> str:
        """Create a new, empty bucket (``name`` plus a unique suffix) and return its URL ``s3://bucket``."""
        bucket = f"{name}-{uuid.uuid4().hex[:8]}".lower()
        fs, _ = storage.filesystem(f"s3://{bucket}")
        fs.mkdir(bucket)  # no region: SeaweedFS refuses a LocationConstraint of us-east-1
        return f"s3://{bucket}"


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A SeaweedFS server on a free 127.0.0.1 port, with ``pipeline.io.storage`` configured to reach it on
    ``s3://`` for the session. Fails (does not skip) when the ``weed`` binary is missing."""
    if s3server.find_weed() is None:
        pytest.fail(s3server.INSTALL_HINT, pytrace=False)
    server = s3server.start(tmp_path_factory.mktemp("seaweedfs"))
    saved = dict(storage._OPTIONS)  # restored below, so later tests see the options they had
    storage.set_options("s3", **server.storage_options())
    try:
        yield S3(server)
    finally:
        storage._OPTIONS.clear()
        storage._OPTIONS.update(saved)
        server.stop()



@pytest.fixture(scope="session")
def ray_cluster():
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token between the test's processes
    import ray
    from ray.cluster_utils import Cluster

    from distributed import FAST_HEALTH, RAY_WORKER

    c = Cluster(initialize_head=True, connect=False,   # no dashboard: no test reads it (2-4% of a core idle)
                head_node_args={"num_cpus": 0, "object_store_memory": RAY_WORKER["object_store_memory"],
                                "include_dashboard": False, "_system_config": FAST_HEALTH})
    try:
        for _ in range(3):
            c.add_node(**RAY_WORKER)
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="session")
def serve_http(ray_cluster) -> str:
    """Ray Serve on the session's cluster, HTTP on a free 127.0.0.1 port (one proxy, on the head), started
    once for the modules that serve; yields its base URL. Each module deploys its own apps on it and deletes
    them when it ends (``serve_apps.deployed``), so the next finds Serve as it was; shut down at the end."""
    from ray import serve

    from ray_head import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def made_once(tmp_path_factory, name: str, make):
    """What ``make(directory)`` returns (paths under that new directory), made once per test run: alone, in
    this session's temporary directory; under pytest-xdist once for all the workers, in the run's directory
    (the first worker to ask makes it while the others wait on a lock, then each reads it)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent / name   # the run's directory: the workers' basetemps' parent
    made = root.with_name(f"{name}.pickle")
    with open(root.with_name(f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        if not made.exists():
            shutil.rmtree(root, ignore_errors=True)   # what a worker that failed making it left
            root.mkdir()
            made.write_bytes(pickle.dumps(make(root)))
        return pickle.loads(made.read_bytes())


@pytest.fixture(scope="session")
def embedded_quantized(tmp_path_factory) -> str:
    """The embedded model quantized with the default recipe (W8A8 + FA3), once per run; read-only."""
    from pipeline.assets import EMBEDDED_MODEL_DIR
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint

    def make(d: Path) -> str:
        quantize_checkpoint(str(EMBEDDED_MODEL_DIR), str(d / "q"), Recipe(), QuantizeOptions(), log=lambda m: None)
        return str(d / "q")

    return made_once(tmp_path_factory, "embedded-quantized", make)


@pytest.fixture(scope="session")
def calib4(tmp_path_factory) -> str:
    """The first four texts of tests/fixtures/calib.json as a calibration file, for the tests whose property
    (an equality of two runs on the same texts, a format, a failure) holds for any texts; read-only."""
    from tiny import first_texts

    path = tmp_path_factory.mktemp("calib4") / "calib.json"
    path.write_text(json.dumps(first_texts(4)))
    return str(path)


@pytest.fixture(scope="session")
def tiny_quantized(tmp_path_factory) -> str:
    """tests/fixtures' tiny checkpoint quantized with the default recipe and options on
    tests/fixtures/calib.json, once per run; read-only (copy it where a test writes)."""
    from pipeline.quant.recipe.recipe import Recipe
    from pipeline.quant.job.run import QuantizeOptions, quantize_checkpoint
    from tiny import FIXTURES, TINY_FIXTURE

    def make(d: Path) -> str:
        quantize_checkpoint(str(TINY_FIXTURE), str(d / "q"), Recipe(),
                            QuantizeOptions(calib_path=str(FIXTURES / "calib.json")), log=lambda m: None)
        return str(d / "q")

    return made_once(tmp_path_factory, "tiny-quantized", make)


@pytest.fixture(scope="session", autouse=True)
def torch_one_thread_by_default():
    """One intra-op torch thread in the test process for the whole session (a test that needs more sets its
    count and restores it), and OMP_NUM_THREADS=1 for every process the tests start (jobs, the session's
    Ray cluster and its workers, served replicas) unless a test sets it. The tests' models and matrices are
    small: one thread is about as fast as two on 2 idle cores, and it stays fast when other processes keep
    the cores busy, where 2 spin-waiting OpenMP threads are several times, up to ~100x, slower. (A job's
    or a rank's own thread setting, such as jobs.generate's for a sharded replica, still applies.)"""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    with environment(OMP_NUM_THREADS="1"):
        yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session", autouse=True)
def free_memory_is_not_checked():
    """The checks that read the machine's free memory, other users' processes included, off for the session
    (a test about one turns it on for itself): on a shared machine another job's memory would otherwise fail
    or kill the tests' small processes.

    - RAY_memory_monitor_refresh_ms=0 for every Ray the tests start (the session's cluster, a job's private
      Ray): Ray's monitor kills a worker, a Serve proxy or a rank, when the machine passes 95%;
    - DSQUANT_SKIP_MEMORY_CHECK=1: jobs.generate's and jobs.serve's up-front check of their engines against
      MemAvailable (tests/test_engine_memory.py tests it)."""
    with environment(RAY_memory_monitor_refresh_ms="0", DSQUANT_SKIP_MEMORY_CHECK="1"):
        yield


@pytest.fixture(scope="module")
def one_torch_thread(torch_one_thread_by_default):
    """A module of small matrices that says it runs on one intra-op thread: the session's default (above)."""
    import torch

    assert torch.get_num_threads() == 1, "a test before this module left its torch thread count changed"


@pytest.fixture(scope="session")
def qdir(embedded_quantized) -> str:
    """The embedded quantized directory (the engine and serving tests' model; read-only)."""
    return embedded_quantized


@pytest.fixture(scope="session")
def tok(embedded_quantized):
    """The embedded model's tokenizer (from the quantized directory)."""
    from pipeline.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(embedded_quantized)


@pytest.fixture(scope="session")
def tiny_references(tmp_path_factory) -> dict:
    """The single-process outputs of the tiny fixture (tests/distributed.py's options) for the plain and
    the smoothing + MTP recipes, once per session: what every distributed run must reproduce."""
    from distributed import PLAIN, SMOOTH_MTP, reference
    from tiny import TINY_FIXTURE

    root = tmp_path_factory.mktemp("tiny-references")
    return {"plain": reference(str(TINY_FIXTURE), root / "plain", PLAIN),
            "smooth-mtp": reference(str(TINY_FIXTURE), root / "smooth", SMOOTH_MTP)}


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """An environment with no AWS credentials anywhere (no variables, files or instance metadata) and an
    endpoint nobody listens on: an s3:// read fails signing its request, before any connection."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    # no s3 options registered by an earlier test (an S3 server's endpoint and keys), and no S3FileSystem an
    # earlier test made: fsspec hands out one cached instance per set of arguments, its credentials and
    # endpoint resolved when it was made
    import s3fs

    from pipeline.io import storage

    monkeypatch.setattr(storage, "_OPTIONS", {k: v for k, v in storage._OPTIONS.items() if k != "s3"})
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()
