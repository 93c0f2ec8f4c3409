"""The config's schema: one frozen dataclass per TOML table, every key with its default.

The keys are a contract (docs/design.md, "Config"): users' files and scripts name them exactly. Reading and
coercion live in reading.py, the checks and the defaults that depend on other keys in validation.py, the
TOML text and the comparison of two configs in writing.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

@dataclass(frozen=True)
class DataConfig:
    kind: str = "synthetic"
    clients: int | None = None  # N; None: 30 for synthetic, the file's N for a quadratic file
    path: str | None = None
    alpha: float = 1.0
    beta: float = 1.0
    iid: bool = False
    samples: str | int | None = None  # synthetic: "lognormal" (FedProx, default), "pareto" or a count;
    # images: "partition" (default: as the partition gives) or "pareto" (with partition = "iid")
    samples_min: int = 50  # Pareto scale (floor)
    samples_max: int | None = None  # cap; None: uncapped for lognormal (as FedProx), 5000 for pareto
    test_fraction: float = 0.1
    noise_std: float = 0.0  # quadratic oracle noise
    dim: int = 10  # generated quadratic (no path) only
    split: str | None = None  # EMNIST split (None: "bymerge", the flexible-participation paper's); CIFAR-100's
    # labels: "fine" (default) or "coarse"
    partition: str | None = None  # "iid", "label", "shards", "dirichlet", "natural" (a file's own devices);
    # None: "natural" for LEAF, else "iid"
    dirichlet_alpha: float = 0.5
    min_partition_size: int = 10  # dirichlet: drawn again while a device holds fewer samples (Flower's default)
    holdout: int = 2000  # images held out for testing when data.path holds only the test files
    normalize: str | None = None  # arrays, LEAF, CIFAR: "none", "standard" (per channel or feature, from the
    # training set) or "unit" (/255); None: "unit" for CIFAR, else "none"
    classes: int | None = None  # arrays, LEAF: the class count C (None: the largest label + 1)
    cache_mb: float = 1024.0  # the built devices' data a process keeps (least recently used goes first)
    vocab_size: int = 10_000  # LEAF Sent140: the training set's most frequent words given ids
    vocab: str | None = None  # LEAF Sent140: a text file of the vocabulary's words, one a line (instead)
    shards: str | None = None  # under MPI: a folder (the same path on every board) of rank-R.h5, each device
    # rank's shard of data.path (launch/pi-cluster.sh data makes them): a device rank reads its own


@dataclass(frozen=True)
class ModelConfig:
    kind: str | None = None  # None: the data's natural model; "sequential": the layers below
    dtype: str = "float32"
    hidden: tuple[int, ...] = (200, 200)  # mlp hidden layers (McMahan et al.'s 2NN)
    layers: tuple[dict, ...] = ()  # sequential: the layer list, tables with a type and its settings (layers/)
    loss: str = "cross_entropy"  # or "mse" (float targets; a sequential model)
    init: str | None = None  # "pytorch", "glorot" or "zeros"; None: pytorch for sequential, the built-ins' own
    module: str | None = None  # torch: the Python file of the user's module (relative to the config file)
    factory: str | None = None  # torch: the function in it, factory(input_shape, n_classes) -> nn.Module
    weights: str | None = None  # start from these: an exported .npz, a run log (.h5), a PyTorch state_dict (.pt)
    weights_round: int | None = None  # a run log's stored round to start from (None: its last)
    cache_features: bool = True  # a frozen prefix's outputs computed once per device, when its data is built


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str = "fedavg"
    weighting: str | None = None  # None: count_selected for fedavg, uniform for scaffold
    clients_per_round: int | float | str = 10
    local_steps: int | None = None  # K; None: 20 unless local_epochs is given
    local_epochs: int | float | None = None  # E; K_k = ceil(E * n_k / B) per device
    batch_size: int | str = 20
    lr_local: float = 0.05
    lr_global: float = 1.0
    lr_schedule: str = "constant"


@dataclass(frozen=True)
class ScaffoldConfig:
    option: str = "II"  # control update: "I" c_k+ = g_k(x), "II" c_k - c + (x - y_k) / (s_k lr)
    init: str = "zero"  # "zero", or "gradient": c_k^0 = full local gradient at x_0 (what SCAFFOLD's rates assume)
    control_gradient: str = "oracle"  # option I's g_k(x): "oracle" (one minibatch, as the paper's algorithm) or "full"


@dataclass(frozen=True)
class FedProxConfig:
    mu: float | None = None  # the proximal weight; None: 0.01 with train.algorithm = "fedprox"


@dataclass(frozen=True)
class ParticipationConfig:
    mode: str = "full"  # "full": K steps; "trace": the steps a trace gives; "deadline": what fits in deadline_s;
    # "async": FedBuff ([async])
    scheme: str = "B"
    trace: str | tuple[str, ...] | None = None  # trace mode: "builtin[:k]", a trace file, a run log, or names
    deadline_s: float | str | None = None  # deadline mode: seconds per device and round, or "auto" / "1.5x":
    # that multiple of the time K steps take on the device's board ([device] profiles; "auto" = 1.1x)
    grace_s: float = 1.0  # a device silent past deadline + grace is recorded inactive for the round
    contention: tuple[float, ...] = ()  # CPU competitor load per device (cycled), as the paper's 0..0.9
    deadline_quantile: float | None = None  # deadline_s = "adaptive": the share q of devices that can finish
    # (None: 0.8)
    deadline_covers: str = "compute"  # "compute": the deadline bounds the local work; "round": the report's arrival
    overselect: float = 0.0  # select ceil((1 + o) S); the round ends when S of them completed their budget
    clock: str | None = None  # "measured" or "simulated" (from board profiles); None: simulated in the simulator
    # when [device] profile is set, else measured


@dataclass(frozen=True)
class ArrivalConfig:
    device: int
    round: int  # the first round the device is part of the federation


@dataclass(frozen=True)
class DepartureConfig:
    device: int
    round: int  # the first round the device is gone
    policy: str = "exclude"  # "exclude": shift the objective; "include": keep it (the device just falls silent)


@dataclass(frozen=True)
class DynamicsConfig:
    arrive: tuple[ArrivalConfig, ...] = ()
    depart: tuple[DepartureConfig, ...] = ()
    fast_reboot: bool = False  # boost an arriving device's coefficient by 1 + (b - 1) / (r - r0 + 1)^2
    boost: float = 3.0  # b


@dataclass(frozen=True)
class AwayConfig:
    devices: tuple[int, ...]  # the devices a board hosted when `edgefed launch` left it out
    round: int  # the first round the world ran without the board
    back: int | None = None  # the first round the board was in the world again (None: not since)


@dataclass(frozen=True)
class MpiConfig:
    device_ranks: tuple[int, ...] = ()  # rank hosting each device; empty: round-robin over ranks 1..P-1
    threads_per_rank: int | None = None  # devices a rank runs at once, a core each; None: its share of its
    # host's cores (with CPU competitors: 1)
    rank_timeout_s: float | None = None  # a rank silent (not even a heartbeat) this long is lost and the world
    # ends; None: 5 graces, at least 10 s (rank_timeout)
    rejoin: bool = True  # edgefed launch takes back a board it left out once it answers again
    rejoin_check_s: float = 10.0  # how often edgefed launch asks the boards it left out
    away: tuple[AwayConfig, ...] = ()  # boards out of the world ([[mpi.away]], written by edgefed launch): their
    # devices stay in the objective and report nothing until back; with [dynamics] fast_reboot their first
    # rounds back are boosted like an arrival's


@dataclass(frozen=True)
class DeviceConfig:
    profile: str | None = None  # hardware profile of the boards: a name in hw_profiles/ or a .toml file
    boards: tuple[str, ...] = ()  # under MPI, each device rank's board (entry i: rank i + 1), overriding profile
    contention: tuple[float, ...] = ()  # under MPI, the CPU competitor load on each device rank's board
    # (entry i: rank i + 1), for every device it hosts; overrides participation.contention there
    speed: tuple[float, ...] = ()  # relative speed of each device (cycled; default 1.0) for simulated clocks
    link_mbps: tuple[float, ...] = ()  # each device's link, megabits per second both ways (cycled; empty:
    # not shaped): a round's bytes take 8 bytes / (mbps 10^6) seconds on it


@dataclass(frozen=True)
class CompressConfig:
    uplink: str = "none"  # what a device's report travels as: "none", "fp16", "int8", "topk"
    downlink: str = "none"  # the round's model broadcast, the same kinds (as a difference to the devices' copy)
    topk_fraction: float = 0.01  # topk: the share of coordinates sent
    error_feedback: bool | None = None  # None: true for a lossy uplink (a device adds back what it did not send)


@dataclass(frozen=True)
class AsyncConfig:
    """Buffered asynchronous aggregation (FedBuff), with participation.mode = "async"; TOML table [async]."""

    concurrency: int = 10  # C: devices training at any time
    buffer: int = 5  # M: reports per server update
    staleness: str = "polynomial"  # w(tau): "constant" 1, or "polynomial" (1 + tau)^-a
    staleness_exponent: float = 0.5  # a
    max_staleness: int = 20  # reports staler than this are discarded (logged late)


@dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation with pairwise masks (Bonawitz et al.; SecAgg+ neighbourhoods): the coordinator
    learns only the sum of the applied devices' scaled updates."""

    enabled: bool = False
    neighbours: int | None = None  # k: the devices each is linked to (SecAgg+); None: all the round's others
    threshold: int | None = None  # t: shares of a device's secrets that rebuild them; None: ceil(2k/3) + 1
    clip: float = 10.0  # a coordinate of a device's scaled update is clipped to [-clip, clip] before encoding
    bits: int = 32  # masks and encodings live in Z_{2^bits}: 16, 32 or 64
    key_source: str = "os"  # "os": key material from the OS's CSPRNG; "seeded": the test mode's stream on
    # (seed, round, device), which makes every key reproducible (and known to anyone with the config)


@dataclass(frozen=True)
class SelectionConfig:
    """Who takes part in a round (docs/design.md 2.18); a parameter left unset takes its policy's default."""

    policy: str = "uniform"  # "uniform", "fedcs", "oort" or "power_of_choice"
    candidates: int | None = None  # fedcs: devices asked, drawn uniformly; power_of_choice: d, by weight (None: 2S)
    alpha: float | None = None  # oort: the system penalty's exponent (2)
    exploration: float | None = None  # oort: the initial exploration share epsilon (0.9)
    exploration_decay: float | None = None  # oort: epsilon's factor per round (0.98)
    exploration_min: float | None = None  # oort: epsilon's floor (0.3)
    cut_off: float | None = None  # oort: the exploitation cut-off c (0.95)
    preferred_s: float | None = None  # oort: T (None: the fixed deadline, else the median predicted round)
    pacer_step: int | None = None  # oort: the pacer's window W in rounds (20)
    pacer_delta: float | None = None  # oort: what the pacer adds to T, s (None: T / 10)


@dataclass(frozen=True)
class PrivacyConfig:
    """User-level differential privacy (DP-FedAvg; docs/design.md 2.19): each applied device's contribution
    clipped, Gaussian noise on their sum, epsilon accounted every round."""

    mechanism: str = "none"  # "none", "central" (the coordinator adds the noise) or "distributed" (the devices)
    clip: float = 1.0  # C: the L2 bound on a device's contribution a_k Delta_k (its rule's multiplier first)
    noise_multiplier: float | None = None  # z: the noise's std is z C; or give epsilon
    epsilon: float | None = None  # a target over the planned rounds: z is the smallest that keeps within it
    delta: float | None = None  # None: 1 / N^1.1
    noise_source: str = "seeded"  # "seeded": the stream (seed, privacy, round); "os": the OS's CSPRNG
    adaptive_clip: bool = False  # C follows a quantile of the update norms (Andrew et al.; clip is C_0)
    target_quantile: float = 0.5  # gamma: the share of updates C should leave unclipped
    clip_lr: float = 0.2  # eta_C: C <- C exp(-eta_C (b - gamma)), b the noised unclipped share
    quantile_noise: float | None = None  # sigma_b: the count's noise; None: S / 20

    @property
    def adapts(self) -> bool:
        """Adaptive clipping is on (with mechanism "none" every other key is inert: a sweep may switch it off)."""
        return self.adaptive_clip and self.mechanism != "none"


@dataclass(frozen=True)
class SubmodelConfig:
    """[submodel]: width-scaled submodels, the other answer to a slow board (docs/design.md 2.23): HeteroFL
    (Diao et al., ICLR 2021) trains a device's fixed width, FjORD (Horvath et al., NeurIPS 2021) draws a width
    per local step up to the device's. Every key unset: every device trains the whole model."""

    method: str | None = None  # "heterofl" or "fjord"; "none" (or unset): the whole model, the other keys inert
    widths: tuple[float, ...] | None = None  # fractions of every hidden layer's units, ascending; None: 0.25, 0.5, 1
    assign: str | tuple[float, ...] | None = None  # "speed" (None): the widest whose K steps fit; or one a device

    @property
    def enabled(self) -> bool:
        return self.method not in (None, "none")


@dataclass(frozen=True)
class FaultConfig:
    """A fault injected into one device's local work in one round, to test what the runtime does."""

    device: int
    round: int
    kind: str = "stall"  # "stall": sleep `seconds` (a hung device); "raise": fail with an error;
    # "slow_link": the device's report takes `seconds` longer to reach the coordinator; "memory": its process
    # takes `mb` more of memory for `seconds` (a board that runs out of memory: the kernel kills the rank)
    seconds: float = 0.0
    mb: float = 0.0


@dataclass(frozen=True)
class LogConfig:
    path: str | None = None
    every: int | None = None  # store the server model every k rounds (and round 0 and R); None: every round,
    # or every k-th where that would exceed trajectory_mb
    trajectory_mb: float = 100.0  # the stored models' budget when every is not set
    eval_every: int = 1
    eval_devices: int | None = None  # the metrics on a fixed uniform sample of this many devices; None: all
    client_controls: bool = False  # also log every device's own vectors (SCAFFOLD's c_k) at the stored rounds


@dataclass(frozen=True)
class Config:
    seed: int = 0
    rounds: int = 100
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaffold: ScaffoldConfig = field(default_factory=ScaffoldConfig)
    fedprox: FedProxConfig = field(default_factory=FedProxConfig)
    participation: ParticipationConfig = field(default_factory=ParticipationConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dynamics: DynamicsConfig = field(default_factory=DynamicsConfig)
    mpi: MpiConfig = field(default_factory=MpiConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)  # TOML [async] (a Python keyword)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    submodel: SubmodelConfig = field(default_factory=SubmodelConfig)
    fault: tuple[FaultConfig, ...] = ()

    @property
    def n_clients(self) -> int:
        return self.data.clients

    def clients_per_round_count(self, n_clients: int) -> int:
        """S for a federation of n_clients: a count, McMahan's max(ceil(C*N), 1), or all."""
        s = self.train.clients_per_round
        if s == "all":
            return n_clients
        if isinstance(s, float):
            return max(math.ceil(s * n_clients - 1e-9), 1)  # 0.07 * 100 is 7.000000000000001 in floats
        return s


def rank_timeout(cfg: Config) -> float:
    """[mpi] rank_timeout_s, or its default: a few graces, never under 10 s (a busy board may pause a while)."""
    return cfg.mpi.rank_timeout_s or max(5 * cfg.participation.grace_s, 10.0)


# Keys that say where and how the devices run, not what the experiment is: a resume may change them (the
# launcher moves the devices of a lost board to the others). In full and trace mode they change no byte.
PLACEMENT = {"mpi": ("device_ranks", "threads_per_rank", "rank_timeout_s", "rejoin", "rejoin_check_s", "away"),
             "device": ("boards", "contention")}


TOML_NAMES = {"asynchronous": "async"}  # fields whose table is named by a Python keyword in TOML
TABLES = {TOML_NAMES.get(f.name, f.name): f.default_factory for f in dataclasses.fields(Config)
          if f.default_factory is not dataclasses.MISSING}
FIELDS = {TOML_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(Config)}  # TOML name -> field
TOP_KEYS = tuple(f.name for f in dataclasses.fields(Config)
                 if f.default_factory is dataclasses.MISSING)  # seed, rounds, fault
