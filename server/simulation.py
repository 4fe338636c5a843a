"""Run fedcompress ServerApps + ClientApps on Flower's Simulation Engine (Ray): a private Ray
instance started in-process, or a running Ray cluster the run attaches to."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)


class RayAddressError(ValueError):
    """``--ray-address`` names no Ray cluster that answers."""


def simulate(server_app, client_app, num_supernodes: int, num_cpus_per_client: float = 1.0,
             verbose: bool = False, ray_address: str = "") -> None:
    """Run a ServerApp and ``num_supernodes`` virtual ClientApps on Ray.

    ``ray_address`` "" (default): a private Ray instance started for this run; Ray helper
    processes it leaves behind are stopped. ``auto`` or ``HOST:PORT``: attach to that running
    cluster (``ray start``); its virtual clients run on any of its nodes, and the cluster and its
    processes are left as they were (Flower's ``ray.shutdown()`` only disconnects a driver that
    attached)."""
    from flwr.simulation import run_simulation

    address = ray_init_address(ray_address)  # a bad address fails here, before any Ray work
    attached = address != "local"
    # Ray workers must not try to reach a hub either, and must find the same model cache. The
    # workers of a private instance inherit this environment; a cluster's workers have the
    # one their node's `ray start` had (the README says what to export there).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    backend_config = {
        # RayBackend passes client_resources to ``ClientAppActor.options()``. It puts an actor
        # whose process died (a crashed or OOM-killed ClientApp) back into its pool: with
        # max_restarts Ray restarts it, else every later message it takes fails too, whichever
        # site it is for. A message sent to an actor while Ray restarts it fails at once
        # ("the actor is restarting"); one retry (max_task_retries) runs it on the restarted
        # actor. The message whose ClientApp killed its process dies again on its retry: that
        # site's reply is an error, which the strategy records.
        "client_resources": {"num_cpus": num_cpus_per_client, "num_gpus": 0.0,
                             "max_restarts": -1, "max_task_retries": 1},
        # Flower's RayBackend passes these to ray.init() as they are.
        "init_args": {"address": address, "logging_level": logging.WARNING,
                      "log_to_driver": True, "include_dashboard": False},
    }
    if attached:
        logger.info("attaching to the Ray cluster at %s", address)
    before = set() if attached else _ray_pids()
    try:
        if not attached:  # Flower's RayBackend finds Ray initialized and uses this instance
            start_private_ray(backend_config["init_args"])
        with actors_killed_at_the_end():
            run_simulation(server_app=server_app, client_app=client_app,
                           num_supernodes=num_supernodes, backend_config=backend_config,
                           verbose_logging=verbose)
    finally:
        if not attached:  # an attached run starts no Ray process: all belong to the cluster
            import ray

            ray.shutdown()  # Flower shuts its backend's Ray down; not if it failed before
            reap_ray_orphans(before)


@contextlib.contextmanager
def actors_killed_at_the_end() -> Iterator[None]:
    """Within this block, Flower's Ray backend ends its virtual clients' actors with
    ``ray.kill`` (no restart) instead of their ``terminate`` task.

    Flower 1.42 ends a run by submitting every actor's ``terminate`` task and calling
    ``ray.shutdown()`` at once. That task ends its actor with ``exit_actor``, which Ray reports
    as a failed task; with ``max_task_retries`` (set above, for actors restarted after a
    ClientApp killed its process) Ray resubmits it, and a resubmission that reaches the raylet
    while ``ray.shutdown()`` stops it makes Ray's core worker end the whole driver process
    ("Exiting because the Raylet IPC connection failed and the local Raylet is dead"): the
    process that ran the ServerApp dies after the run, silently, with whatever it had still to
    do (seen: a script's second simulation never started). ``ray.kill`` submits no task."""
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    original = BasicActorPool.terminate_all_actors

    def terminate_all_actors(pool) -> None:
        import ray

        for actor in pool.pool:
            ray.kill(actor, no_restart=True)
        logger.debug("killed %d actor(s)", len(pool.pool))

    BasicActorPool.terminate_all_actors = terminate_all_actors  # type: ignore[method-assign]
    try:
        yield
    finally:
        BasicActorPool.terminate_all_actors = original  # type: ignore[method-assign]


#: What Ray raises when its local node did not register with its GCS within Ray's fixed 30 s
#: (``raylet_start_wait_time_s`` in ``ray/_private/node.py``, not configurable): seen on a
#: 2-core machine that other work loads.
RAY_NODE_STARTUP_TIMEOUT = "The current node timed out during startup"
#: Starts of a private Ray instance when its node times out at startup (see above).
RAY_START_ATTEMPTS = 2


def start_private_ray(init_args: dict, attempts: int = RAY_START_ATTEMPTS) -> None:
    """Start this run's private Ray instance as Flower's ``RayBackend.init_ray`` would (flwr
    1.42: the same ``init_args``, the driver's ``sys.path`` as the workers' PYTHONPATH, in the
    environment and in the runtime env), so that Flower finds Ray initialized and uses it, and
    shuts it down at the end as it would its own. When Ray's local node does not register in
    time (:data:`RAY_NODE_STARTUP_TIMEOUT`), the processes that start left are stopped and Ray
    is started again, ``attempts`` starts in all; any other failure is raised at once. Nothing
    of the run has started by then: no ServerApp, no ClientApp."""
    import ray

    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts={attempts!r}: expected an integer >= 1")
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath  # Ray's processes inherit it, as under Flower
    for attempt in range(1, attempts + 1):
        before = _ray_pids()
        try:
            ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
            return
        except Exception as err:
            if not _is_node_startup_timeout(err):
                raise
            started = _stop_started_ray(before)
            if attempt == attempts:
                raise RuntimeError(
                    f"Ray's local node did not start: it timed out {attempts} time(s) "
                    f"(Ray waits a fixed 30 s for it to register); is the machine loaded? "
                    f"(Ray said: {err})") from err
            logger.warning("Ray's local node timed out during startup (start %d of %d; Ray "
                           "waits a fixed 30 s, which a loaded machine can miss): stopped "
                           "the %d process(es) it left and starting Ray again", attempt,
                           attempts, len(started))


def _is_node_startup_timeout(err: BaseException | None) -> bool:
    """Whether ``err`` or an exception it was raised from or during is Ray's node timeout."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if RAY_NODE_STARTUP_TIMEOUT in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _stop_started_ray(before: set[int]) -> list[int]:
    """Stop the Ray processes a failed ``ray.init`` of this process left (not in ``before``,
    this process's descendants: another Ray instance's processes are not touched)."""
    import psutil
    import ray

    ray.shutdown()  # disconnects whatever part of the driver got connected
    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    stopped: list[int] = []
    for pid in sorted((_ray_pids() - before) & ours):
        try:
            proc = psutil.Process(pid)
            proc.kill()
            proc.wait(10)
            stopped.append(pid)
        except psutil.NoSuchProcess:
            continue
    return stopped


def ray_init_address(ray_address: str, timeout: float = 5.0) -> str:
    """The ``address`` for ``ray.init`` from ``--ray-address``: ``local`` for "" (a private
    instance, even if RAY_ADDRESS is set or a ``ray start`` cluster runs on this machine, which
    ``ray.init()`` would otherwise join), else the cluster's ``HOST:PORT`` (``auto``: the one
    RAY_ADDRESS or the latest ``ray start`` on this machine names), checked to answer as a Ray
    cluster within ``timeout`` seconds, so that a wrong address fails at once, by name."""
    text = (ray_address or "").strip()
    if not text:
        return "local"
    if text == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            text = canonicalize_bootstrap_address("auto") or ""
        except (ConnectionError, ValueError) as err:
            raise RayAddressError(f"--ray-address auto: no running Ray cluster found ({err}); "
                                  "start one with `ray start --head` or give HOST:PORT") from err
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536 or "/" in host:
        raise RayAddressError(f"--ray-address {ray_address!r}: expected 'auto' or HOST:PORT, "
                              "the address `ray start --head` printed (e.g. 10.0.0.5:6379)")
    target = f"[{host}]:{port_text}" if ":" in host else f"{host}:{port_text}"
    problem = _gcs_problem(target, timeout)
    if problem:
        raise RayAddressError(f"--ray-address {ray_address}: {problem}; is `ray start --head "
                              f"--port {port_text}` running there and the port reachable?")
    return text


def _gcs_problem(target: str, timeout: float) -> str:
    """Why ``target`` is not a Ray cluster's GCS ("" when it answers as one): one gRPC call, the
    one a Ray driver makes first. A TCP connection alone proves little (a proxy or another
    service may accept it)."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # another Ray layout: a TCP connection it is
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as err:
            return f"no Ray cluster answers at {target} ({err.strerror or err})"
        return ""
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(),  # type: ignore[attr-defined]
                timeout=timeout)
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.UNAUTHENTICATED:  # a GCS with token auth (ray.init
                return ""  # sends the token)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return (f"no Ray cluster answers at {target} within {timeout:g} s "
                        f"({code.name}: {err.details()})")  # type: ignore[attr-defined]
            return (f"{target} answers, but not as a Ray cluster (gRPC {code.name}: "
                    f"{err.details()})")  # type: ignore[attr-defined]
    return ""


def simulate_method(name: str, settings: dict, num_cpus_per_client: float = 1.0,
                    verbose: bool = False, ray_address: str = "") -> None:
    """Run method ``name`` of the registry with flat ``settings`` on the Simulation Engine:
    its ServerApp with these settings and the one ClientApp (``clients/app.py``), one virtual
    node per client, on a private Ray instance or the cluster at ``ray_address`` (see
    ``simulate``). Every setting is checked before Ray starts."""
    import importlib

    from clients.app import app as client_app
    from fedcompress.methods import get_method

    method = get_method(name)
    server = importlib.import_module(method.server_module)
    server.check_settings(settings)  # fail on bad settings before Ray starts
    clients = method.parse(settings)[0].clients
    simulate(server.make_app(settings), client_app, clients, num_cpus_per_client, verbose,
             ray_address)


def _ray_pids() -> set[int]:
    import psutil

    pids = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        text = " ".join(proc.info["cmdline"] or []) or (proc.info["name"] or "")
        if text.startswith("ray::") or "/ray/" in text:
            pids.add(proc.info["pid"])
    return pids


def reap_ray_orphans(before: set[int], grace: float = 3.0, settle: float = 15.0) -> list[int]:
    """Kill Ray helper processes that this run started and that outlived it as orphans
    (``ray.shutdown`` can leave a dashboard/runtime-env agent behind, and an actor Ray was
    restarting when the run ended can come up after it). After ``grace`` seconds, orphans are
    killed as they appear until no process of this run is left or ``settle`` more seconds have
    passed. Processes of another live Ray instance keep their parent, or predate ``before``,
    and are not touched; a run attached to a cluster never calls this."""
    import time

    import psutil

    time.sleep(grace)
    killed: list[int] = []
    deadline = time.monotonic() + settle
    while True:
        left = _ray_pids() - before
        for pid in left:
            try:
                proc = psutil.Process(pid)
                if proc.ppid() == 1 and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    killed.append(pid)
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if killed:
        logger.info("stopped %d leftover Ray process(es): %s", len(killed), killed)
    return killed
