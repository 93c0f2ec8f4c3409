"""`[model] weights`: the parameters a run starts from, read from a file instead of drawn from the seed.

Three kinds of file, each read into a state_dict (names and PyTorch's shapes) that the model takes as its
whole parameter vector, the frozen tensors included: an `.npz` as `edgefed export --weights` writes it, a run
log (its last stored round, or `[model] weights_round`), or a PyTorch state_dict (`.pt`, `.pth`; with the
torch extra). The process that writes the log reads it before anything is written, and under MPI sends the
state_dict to the device ranks with the run's setup; a resumed run takes it from its own log.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError, EdgefedError

TORCH_SUFFIXES = (".pt", ".pth")
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def read_weights(path: str, round_idx: int | None = None) -> dict[str, np.ndarray]:
    """The state_dict a weights file holds (its kind told by its first bytes, then its suffix)."""
    where = _where(path)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{where} {'is a folder' if p.is_dir() else 'does not exist'}; give an .npz that edgefed "
                          "export --weights wrote, a run log (.h5) or a PyTorch state_dict (.pt)")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read ({exc.strerror or exc})") from None
    if head == HDF5_SIGNATURE:
        return _from_log(p, round_idx, where)
    if round_idx is not None:
        raise ConfigError(f"config: model.weights_round picks a round of a run log, and {path} is not one; remove it")
    if p.suffix in TORCH_SUFFIXES:
        return _from_torch(p, where)
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):  # a zip's first entry, or an empty zip's end record
        return _from_npz(p, where)
    raise ConfigError(f"{where} is neither an .npz, a run log nor a PyTorch state_dict (.pt, .pth); give the file "
                      "edgefed export --weights wrote, the run's log, or torch.save(module.state_dict(), PATH)")


def _from_npz(p: Path, where: str) -> dict[str, np.ndarray]:
    try:
        with np.load(p, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"{where} cannot be read as an .npz ({exc}); give the file edgefed export --weights "
                          "wrote") from None


def _from_torch(p: Path, where: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ConfigError(f"{where} is a PyTorch file, which needs the torch extra (pip install 'edgefed[torch]'); "
                          "or save it as an .npz: numpy.savez(PATH, **{k: v.numpy() for k, v in "
                          "state_dict.items()})") from None
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch's unpickler raises many kinds; its message, in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{where} cannot be read by torch.load(weights_only=True) ({first}); save the module's "
                          "state_dict, torch.save(module.state_dict(), PATH)") from None
    if isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        for key in ("state_dict", "model_state_dict", "model"):  # a training checkpoint around it
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{where} holds {type(state).__name__}, not a state_dict of tensors; save "
                          "torch.save(module.state_dict(), PATH)")
    return {str(k): v.detach().cpu().numpy() for k, v in state.items()}


def _from_log(p: Path, round_idx: int | None, where: str) -> dict[str, np.ndarray]:
    from edgefed.analysis.export import stored_weights
    from edgefed.analysis.logs import Run

    try:
        _, weights, _ = stored_weights(Run.read(p), round_idx, "config: model.weights_round = ")
    except EdgefedError as exc:  # (a round it does not store names weights_round itself)
        raise ConfigError(str(exc) if str(exc).startswith("config:") else f"{where}: {exc}") from None
    return weights


def resumed_weights(path: str, round_idx: int | None, log: Path) -> tuple[dict[str, np.ndarray], str | None]:
    """(the state_dict a resumed run started from, a warning or None): the run's log holds it (round 0 is x_0,
    /model/frozen the frozen tensors), so the file model.weights names may have moved or changed since; the
    warning says so when it has."""
    logged = read_weights(str(log), 0)
    if not Path(path).is_file():
        return logged, (f"warning: {_where(path)[len('config: '):]} is gone; the resumed run takes the weights it "
                        "started from (x_0 and the frozen tensors) from its log")
    try:
        given = read_weights(path, round_idx)
    except ConfigError:
        given = None
    same = given is not None and given.keys() == logged.keys() and all(
        np.array_equal(np.asarray(given[k]).astype(v.dtype), v) for k, v in logged.items())
    if same:
        return logged, None
    return logged, (f"warning: {_where(path)[len('config: '):]} is not the file the run started from (it changed "
                    "since, or cannot be read); the resumed run keeps the weights it started from, which its log holds")


def _where(path: str) -> str:
    return f"config: model.weights = {path!r}"
