"""How a program chooses its placements: the "auto" rules of --data-placement and
--state-placement, and the refusals of what a placement cannot run."""

from __future__ import annotations

from typing import Any

import jax

from fedjax_pfl.core.data_placement import DATA_PLACEMENTS
from fedjax_pfl.core.memory import available_memory, nbytes
from fedjax_pfl.core.state_placement import STATE_PLACEMENTS

STATE_DTYPES = ("float32", "bfloat16")


def device_data_fits(data, state_bytes: int, mesh, share: int = 1) -> bool:
    """"auto" placement: the dataset (1/`share` of it: sharded placement) on every device of this
    host plus the client state (`state_bytes`; 0 for an untraceable init, judged by the data
    alone) within 80 % of the available memory, before anything is compiled."""
    devices = 1 if mesh is None else mesh.size
    platform = jax.local_devices()[0].platform
    available = available_memory(platform)
    if available <= 0:
        return True
    sharing = min(devices, jax.local_device_count()) if platform == "cpu" else 1
    return (nbytes((data.x, data.y)) * sharing / share + state_bytes) <= 0.8 * available


def state_placement(placement: str, algo, abstract: Any, jit: bool) -> str:
    """"host" or "device" for --state-placement `placement`. "host" needs a vectorised backend,
    a traceable init and an algorithm that declares `host_state` (ValueError naming the reason
    otherwise); "auto" picks "host" only where all of that holds and the client state alone
    would take more than 80 % of the available memory. With several processes each process's
    store holds its own range of clients' rows (`store.row_owners`)."""
    if placement == "device":
        return "device"
    reasons = []
    if not jit:
        reasons.append("a vectorised --backend (not loop)")
    if abstract is None:
        reasons.append("an init that can be traced (this algorithm's init needs concrete data)")
    if not getattr(algo, "host_state", False):
        reasons.append(f"an algorithm whose rounds touch client state only through core.gather / "
                       f"core.scatter at the round's participants ({algo.name} does not declare "
                       "Algorithm.host_state: it reads other clients' rows, updates every client "
                       "each round, or starts clients from different rows)")
    if placement == "host":
        if reasons:
            raise ValueError("--state-placement host needs " + "; and ".join(reasons))
        return "host"
    if reasons:
        return "device"
    available = available_memory(jax.local_devices()[0].platform)
    return "host" if available > 0 and nbytes(abstract) > 0.8 * available else "device"


def data_placement(placement: str, algo, data, abstract: Any, mesh, jit: bool,
                   state_placement: str) -> str:
    """"device", "host" or "sharded" for --data-placement `placement` (the refusals of what a
    placement cannot run: ValueError naming the flag). "sharded" on one device is "device" (it
    holds every client's samples anyway); "auto": device when the dataset and the client state
    fit in 80 % of the available memory, else sharded when a 1/D share does (several devices,
    an algorithm that reads samples as it trains), else host."""
    several = mesh is not None and mesh.size > 1
    blocks = getattr(algo, "data_blocks", True)
    if placement in ("host", "sharded") and not jit:
        raise ValueError(f"--data-placement {placement} needs a vectorised --backend (not loop)")
    if placement == "sharded" and several and not blocks:
        raise ValueError(f"--data-placement sharded: {algo.name} reads client samples in "
                         "another order than it trains its clients (Algorithm.data_blocks is "
                         "False), so each device needs every sample: use --data-placement "
                         "device or host")
    if placement == "sharded" and not several:
        return "device"
    if placement != "auto":
        return placement
    state_bytes = 0 if abstract is None or state_placement == "host" else nbytes(abstract)
    if device_data_fits(data, state_bytes, mesh) or not jit:
        return "device"
    if several and blocks and device_data_fits(data, state_bytes, mesh, share=mesh.size):
        return "sharded"
    return "host"


def check_options(state_dtype: str, rounds_per_call: int, jit: bool, data_placement: str,
                  state_placement: str, poisson: bool) -> None:
    """The program's options as given (ValueError naming the flag at fault)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"--state-dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    if rounds_per_call < 1:
        raise ValueError(f"--rounds-per-call must be >= 1, got {rounds_per_call}")
    if not jit and rounds_per_call > 1:
        raise ValueError("--rounds-per-call needs a vectorised --backend (not loop)")
    if data_placement not in DATA_PLACEMENTS:
        raise ValueError(f"--data-placement must be one of {list(DATA_PLACEMENTS)}, "
                         f"got {data_placement!r}")
    if state_placement not in STATE_PLACEMENTS:
        raise ValueError(f"--state-placement must be one of {list(STATE_PLACEMENTS)}, "
                         f"got {state_placement!r}")
    if poisson and (data_placement in ("host", "sharded") or state_placement == "host"):
        raise ValueError("--sampling poisson runs with device placement only (its rounds "
                         "hold empty slots that host and sharded placement's per-round "
                         "staging does not expect): use --data-placement device "
                         "--state-placement device")
