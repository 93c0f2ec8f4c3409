"""Flower baseline: round overhead of Flower's Ray-backed simulation on the logistic-regression workload.

Run it with the Python of a separate Flower virtualenv (it does not import edgefed, and Flower's pins must not
touch the project's numpy/numba/torch):

    python -m venv /work/flower-venv && /work/flower-venv/bin/pip install 'flwr[simulation]'
    /work/flower-venv/bin/python benchmarks/flower_baseline.py --data FILE.npz --rounds 30 --steps 5 --batch 20 --lr 0.05

FILE.npz holds x0, y0, x1, y1, ... (float32 features of dimension `dim`, int64 labels in 0..n_classes-1), one
pair per client, plus the scalars `n_classes` and `dim`.

What runs (written against flwr 1.42 / ray 2.55, the versions this was measured with):
  * API: the Message API. `flwr.simulation.run_simulation(server_app, client_app, num_supernodes=N,
    backend_config=...)` with a `ServerApp` whose `@app.main()` runs `flwr.serverapp.strategy.FedAvg.start()`
    and a `ClientApp` with an `@app.train()` handler. `run_simulation` is deprecated in favour of the
    `flwr run` CLI, but it is still the in-process Simulation Engine (the same InMemoryGrid, VCE and Ray
    backend `flwr run` uses for a local simulation) and it lets one script own the clock.
  * Strategy: FedAvg over every client each round (fraction_train=1.0, min_train_nodes = min_available_nodes
    = N), weighted by each client's sample count ("num-examples"); fraction_evaluate=0.0, so no federated
    evaluation round is sent, and no centralized evaluate_fn.
  * Model: multinomial logistic regression, one flat float32 vector of d*C + C parameters, W (d x C,
    row-major) then b (C), zero init (edgefed's layout). A client's train does K SGD steps, each on a batch
    of B rows drawn without replacement by a numpy Generator seeded from (seed, client, round), with the
    mean softmax cross-entropy gradient in NumPy, and replies with its parameters and its sample count.
  * Clock: time.perf_counter() is read as the script's very first statement, before numpy or flwr is
    imported. A FedAvg subclass stamps the end of every round in aggregate_train (after the aggregation).
    start_to_first_round_s = end of round 1 - script start (interpreter + imports + data load + Ray start-up
    + actor pool + round 1); per_round_ms = mean of the gaps between consecutive round ends, rounds 2..R.
  * final_loss: the mean over clients (unweighted) of the softmax cross-entropy of the final global model on
    each client's whole data, computed after the last round (outside the timed part); initial_loss is the
    same for the zero model (= ln C), so final_loss < initial_loss says the baseline trains.
  * client_compute_ms_per_round: the clients' own local_sgd time (measured inside the actors), summed over
    the N clients of a round and averaged over rounds 2..R: the part of per_round_ms that is not Flower/Ray.

Ray resources: ray.init(num_cpus=--ray-cpus, default os.cpu_count(), here 2) and client_resources
{"num_cpus": --client-cpus, default 1, "num_gpus": 0}. Flower's default is num_cpus=2 per client, which on a
2-core machine gives an actor pool of ONE actor, so the 10 clients of a round would run one after another;
num_cpus=1 gives two actors (one per core), the most parallelism the machine has, and the fair setting to
compare with a runtime that runs two workers. Fractional values (e.g. 0.5 -> 4 actors) only oversubscribe
the 2 cores. object_store_memory is capped at 256 MB (the default reserves 30% of RAM on a shared machine;
the model is 2.4 KB). Flower's telemetry and Ray's usage stats are switched off (no network here).

Known properties of this Flower version that shape the numbers:
  * Rounds are quantised to ~100 ms. The ServerApp's InMemoryGrid.send_and_receive polls for replies every
    `pull_interval` = 0.1 s, and the Simulation Engine's own thread that hands queued messages to the Ray
    workers (vce_api.add_messages_to_queue) also polls every 0.1 s. A round costs 1, 2 or 3 poll periods
    (~105, ~207, ~310 ms) depending on whether dispatch + the N Ray calls fit in the first period. This
    script leaves those defaults alone (they are what a Flower user gets); `--pull-interval` overrides the
    ServerApp's interval only, for a floor measurement.
  * Start-up: the ServerApp's node sampling sleeps 1 s while the nodes register, and the Ray backend
    (ray.init with a runtime_env, then the actor pool importing flwr in each worker) starts inside round 1,
    so start_to_first_round_s is dominated by Ray's start-up and grows quickly with CPU contention.

Output: Flower's and Ray's console output goes to stderr (file descriptor 1 is pointed at 2 for the run),
and exactly one JSON line is written to the real stdout at the end.
"""

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs; silences Ray 2.5x's FutureWarning

import numpy as np  # noqa: E402


# ---------------------------------------------------------------------------------------------------------
# Model: multinomial logistic regression on a flat parameter vector (W row-major d x C, then b), NumPy only.
# ---------------------------------------------------------------------------------------------------------


def _split(params, dim, n_classes):
    nw = dim * n_classes
    return params[:nw].reshape(dim, n_classes), params[nw:]


def loss_and_grad(params, X, y, n_classes, want_grad=True):
    """Mean softmax cross-entropy over the rows of X, and its gradient w.r.t. the flat params."""
    W, b = _split(params, X.shape[1], n_classes)
    z = X @ W + b
    z = z - z.max(axis=1, keepdims=True)
    ez = np.exp(z)
    s = ez.sum(axis=1, keepdims=True)
    rows = np.arange(X.shape[0])
    loss = float(np.mean(np.log(s[:, 0]) - z[rows, y]))
    if not want_grad:
        return loss, None
    delta = ez / s
    delta[rows, y] -= 1.0
    delta /= X.shape[0]
    grad = np.concatenate([(X.T @ delta).ravel(), delta.sum(axis=0)]).astype(params.dtype, copy=False)
    return loss, grad


def local_sgd(params, X, y, n_classes, steps, batch, lr, rng):
    """K minibatch SGD steps in place; returns the mean minibatch loss seen along the way."""
    n = X.shape[0]
    b = min(batch, n)
    lr = params.dtype.type(lr)
    losses = []
    for _ in range(steps):
        idx = rng.choice(n, size=b, replace=False)
        loss, grad = loss_and_grad(params, X[idx], y[idx], n_classes)
        params -= lr * grad
        losses.append(loss)
    return float(np.mean(losses)) if losses else float("nan")


def load_data(path):
    with np.load(path) as f:
        n_classes, dim = int(f["n_classes"]), int(f["dim"])
        n = 0
        while f"x{n}" in f.files:
            n += 1
        clients = [(np.ascontiguousarray(f[f"x{k}"], np.float32), np.asarray(f[f"y{k}"], np.int64)) for k in range(n)]
    if n == 0:
        raise SystemExit(f"{path}: no x0/y0 arrays")
    for k, (X, y) in enumerate(clients):
        if X.ndim != 2 or X.shape[1] != dim or y.shape != (X.shape[0],):
            raise SystemExit(f"{path}: client {k} has x{X.shape} y{y.shape}, expected (n, {dim}) and (n,)")
    return clients, dim, n_classes


def client_data(path, cid):
    """(X, y, dim, n_classes) of one client, loaded once per Ray worker process.

    The ClientApp is cloudpickled by value into the actors (it is defined in __main__), so a module-level
    dict would be a fresh copy on every call; the cache hangs off sys.modules, which outlives the calls.
    """
    import types

    mod = sys.modules.get("_flower_baseline_cache")
    if mod is None:
        mod = types.ModuleType("_flower_baseline_cache")
        mod.data = {}
        sys.modules["_flower_baseline_cache"] = mod
    if path not in mod.data:
        mod.data[path] = load_data(path)
    clients, dim, n_classes = mod.data[path]
    X, y = clients[cid]
    return X, y, dim, n_classes


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="npz with x0, y0, x1, y1, ..., n_classes, dim")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--steps", type=int, required=True, help="local SGD steps per round (K)")
    p.add_argument("--batch", type=int, required=True, help="minibatch size (B)")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 1, help="CPUs Ray may use (ray.init num_cpus)")
    p.add_argument("--client-cpus", type=float, default=1.0, help="client_resources num_cpus per ClientApp actor")
    p.add_argument("--pull-interval", type=float, default=None,
                   help="override InMemoryGrid's reply polling interval (Flower's default: 0.1 s); floor runs only")
    p.add_argument("--verbose", action="store_true", help="Flower's INFO log (to stderr); default: warnings only")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (per-round time is measured over rounds 2..R)")
    return args


def main(argv=None):
    args = parse_args(argv)

    # From here on, fd 1 is stderr: Flower's console handler, Ray's forwarded worker output and any print
    # land there; the JSON result goes to the saved real stdout.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)

    clients, dim, n_classes = load_data(args.data)
    n_clients = len(clients)
    n_params = dim * n_classes + n_classes
    data_path = os.path.abspath(args.data)

    try:
        import flwr
        import ray
    except ImportError as ex:
        raise SystemExit(
            f"flower_baseline: {ex}. Run this script with the Python of a Flower virtualenv, e.g.\n"
            "  python -m venv /work/flower-venv && /work/flower-venv/bin/pip install 'flwr[simulation]'\n"
            "  /work/flower-venv/bin/python benchmarks/flower_baseline.py --data FILE.npz ..."
        ) from None
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    flwr_version = getattr(flwr, "__version__", None) or _version("flwr")
    logging.getLogger("flwr").setLevel(logging.INFO if args.verbose else logging.WARNING)

    if args.pull_interval is not None:
        from flwr.superlink.grid import inmemory_grid

        _orig_init = inmemory_grid.InMemoryGrid.__init__

        def _init(self, *a, **kw):
            _orig_init(self, *a, **kw)
            self.pull_interval = args.pull_interval

        inmemory_grid.InMemoryGrid.__init__ = _init

    round_ends = []
    compute_ms = []  # per round: the sum over clients of the time spent in local_sgd (in the actors)

    class TimedFedAvg(FedAvg):
        """FedAvg that stamps the end of each round (after aggregation) with perf_counter."""

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            arrays, metrics = super().aggregate_train(server_round, replies)
            round_ends.append(time.perf_counter())
            compute_ms.append(1e3 * sum(
                float(m.content["metrics"]["compute-s"]) for m in replies if m.has_content()
            ))
            return arrays, metrics

    # ----- ClientApp ---------------------------------------------------------------------------------
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = msg.content["config"]
        cid = int(context.node_config["partition-id"])
        X, y, _, C = client_data(str(cfg["data"]), cid)
        params = msg.content["arrays"].to_numpy_ndarrays()[0].astype(np.float32, copy=True)
        t0 = time.perf_counter()
        rng = np.random.default_rng([int(cfg["seed"]), cid, int(cfg["server-round"])])
        loss = local_sgd(params, X, y, C, int(cfg["steps"]), int(cfg["batch"]), float(cfg["lr"]), rng)
        elapsed = time.perf_counter() - t0
        content = RecordDict({
            "arrays": ArrayRecord([params]),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": int(X.shape[0]), "compute-s": elapsed}),
        })
        return Message(content=content, reply_to=msg)

    # ----- ServerApp ---------------------------------------------------------------------------------
    server_app = ServerApp()
    outcome = {}

    @server_app.main()
    def server_main(grid: Grid, context: Context) -> None:
        strategy = TimedFedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=n_clients,
            min_evaluate_nodes=0,
            min_available_nodes=n_clients,
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord([np.zeros(n_params, np.float32)]),
            num_rounds=args.rounds,
            train_config=ConfigRecord({
                "data": data_path, "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
            }),
        )
        outcome["params"] = result.arrays.to_numpy_ndarrays()[0]

    backend_config = {
        "client_resources": {"num_cpus": args.client_cpus, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": args.ray_cpus,
            "num_gpus": 0,
            "include_dashboard": False,
            "object_store_memory": 256 * 1024 * 1024,
            "logging_level": "WARNING",
        },
    }
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=n_clients,
            backend_config=backend_config,
            verbose_logging=args.verbose,
        )
    finally:
        ray_version = ray.__version__
        if ray.is_initialized():
            ray.shutdown()

    if len(round_ends) != args.rounds or "params" not in outcome:
        raise SystemExit(f"simulation ended after {len(round_ends)} of {args.rounds} rounds")

    def mean_loss(params):
        return float(np.mean([loss_and_grad(params, X, y, n_classes, want_grad=False)[0] for X, y in clients]))

    gaps_ms = [1e3 * (b - a) for a, b in zip(round_ends, round_ends[1:])]
    out = {
        "flwr": flwr_version,
        "ray": ray_version,
        "clients": n_clients,
        "rounds": args.rounds,
        "start_to_first_round_s": round(round_ends[0] - T_START, 4),
        "per_round_ms": round(float(np.mean(gaps_ms)), 3),
        "per_round_ms_list": [round(g, 3) for g in gaps_ms],
        "initial_loss": round(mean_loss(np.zeros(n_params, np.float32)), 6),
        "final_loss": round(mean_loss(outcome["params"]), 6),
        "client_compute_ms_per_round": round(float(np.mean(compute_ms[1:])), 3),
        "ray_cpus": args.ray_cpus,
        "client_cpus": args.client_cpus,
    }
    if args.pull_interval is not None:
        out["pull_interval_s"] = args.pull_interval
    sys.stdout.flush()
    os.write(real_stdout, (json.dumps(out) + "\n").encode())
    os.close(real_stdout)


def _version(dist):
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
