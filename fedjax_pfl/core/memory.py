"""The memory plan of a run: the bytes each device needs, before anything is allocated, and where
the run stops fitting (`MemoryPlan`, `check_memory`)."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np


class MemoryPlanError(ValueError):
    """The run would not fit in memory; the message names the flags that help."""


@dataclasses.dataclass
class MemoryPlan:
    """Bytes per device of a run (CPU devices share the host's memory, so they add up)."""

    devices: int
    platform: str
    num_clients: int
    state_per_client: int          # bytes of one client's state rows (storage dtype)
    client_state_per_device: int   # N / devices × state_per_client
    replicated_state: int          # global models, server state, … (on every device)
    data: int                      # the dataset on each device (replicated), or the streamed buffers
    working_set: int               # XLA temporaries of one compiled round (per device)
    eval_working_set: int          # XLA temporaries of one evaluation (per device)
    available: int                 # bytes the run may use (this host's devices together on CPU)
    local_devices: int = 0         # devices of this process (0: all of `devices`)
    data_placement: str = "device"
    data_whole: int = 0            # the whole dataset's bytes (on each device, or on the host)
    compiled: bool = True          # False: the working sets are not known yet (0 here)
    state_placement: str = "device"
    host_row_bytes: int = 0        # host placement: one client's rows in the host store
    world_rows: int = 0            # host placement: client rows on each device (a call's world)
    # host placement, several processes: rows each device receives from its process before the
    # world is assembled (transient)
    staging_rows: int = 0
    frozen: int = 0                # a model's frozen parameters (a pretrained base): once a device

    @property
    def per_device(self) -> int:
        return (self.client_state_per_device + self.replicated_state + self.frozen + self.data
                + max(self.working_set, self.eval_working_set, self.staging))

    @property
    def staging(self) -> int:
        """Bytes of the rows a device holds while a world is assembled (several processes,
        `transfer.assemble`): freed before the round runs, so counted as a working set."""
        return self.staging_rows * self.host_row_bytes

    @property
    def _sharing(self) -> int:
        """Devices that draw on the memory `available` measures: this process's CPU devices
        share its host's memory (another process's devices are another host's); an accelerator
        has its own."""
        if self.platform != "cpu":
            return 1
        return self.local_devices or self.devices

    @property
    def total(self) -> int:
        """What the run needs from the memory `available` measures."""
        return self.per_device * self._sharing

    def fits(self) -> bool:
        return self.available <= 0 or self.total <= self.available

    def max_clients(self) -> int | None:
        """The N at which the run would stop fitting (same data, other things equal)."""
        if self.available <= 0 or self.state_per_client == 0:
            return None
        fixed = self.per_device - self.client_state_per_device
        per_device_budget = self.available / self._sharing - fixed
        return max(0, int(per_device_budget * self.devices / self.state_per_client))

    def describe(self) -> str:
        mb = lambda b: f"{b / 2**20:,.1f} MB"
        lines = [
            f"memory plan ({self.devices} {self.platform} device{'s' if self.devices > 1 else ''}, "
            f"{self.num_clients} clients): per device {mb(self.per_device)} = client state "
            f"{mb(self.client_state_per_device)} ({mb(self.state_per_client)} per client, sharded) "
            f"+ replicated state {mb(self.replicated_state)} + data {mb(self.data)} + working set "
            f"{mb(max(self.working_set, self.eval_working_set))}"
            + (f" + frozen base {mb(self.frozen)} (once per device)" if self.frozen else ""),
        ]
        if not self.compiled:
            lines.append("  working set not known yet: Program.compile first (a round's "
                         "temporaries can be as large as the client state)")
        if self.state_placement == "host":
            lines.append(
                f"  client state on the host: {mb(self.host_row_bytes)} per client that a round "
                f"has written (copy-on-write: the others share one initial row); each call moves "
                f"its participants' rows to the devices, each device the rows of the clients it "
                f"trains first ({self.world_rows} clients a device, "
                f"{mb(self.world_rows * self.host_row_bytes)}, counted in the client state above)")
            if self.staging_rows:
                lines.append(
                    f"  several processes: each device first receives its process's rows of the "
                    f"whole world ({self.staging_rows} clients, {mb(self.staging)}), then one "
                    f"gather assembles its own; counted as a working set")
        if self.data_placement == "host":
            lines.append(f"  data on the host ({mb(self.data_whole)}); on each device only the "
                         f"streamed buffers ({mb(self.data)}: this round's and the next round's "
                         "participants, or one evaluation group)")
        elif self.data_placement == "sharded":
            lines.append(f"  data sharded over the devices ({mb(self.data_whole)} in all); on "
                         f"each device {mb(self.data)}: its clients' samples, the round's block "
                         "of participants and the exchange's buffers")
        elif self.data_whole:
            lines.append(f"  data on every device ({mb(self.data_whole)}); --data-placement "
                         "sharded would keep 1/D of it on each device, host would keep it on the "
                         "host, each moving only a round's participants' samples to the devices")
        if self.available > 0:
            limit = self.max_clients()
            lines.append(f"  needs {mb(self.total)} of {mb(self.available)} available"
                         + (f"; stops fitting at about {limit:,} clients" if limit else ""))
        return "\n".join(lines)


def available_memory(platform: str) -> int:
    """Bytes available: the host's MemAvailable on CPU, otherwise the limit of this process's
    first device (`jax.devices()[0]` may be another process's, with no statistics here)."""
    if platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 0))


def itemsize(dtype) -> int:
    """Bytes per element (PRNG key arrays included: their dtype knows its own size)."""
    return int(dtype.itemsize)


def nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(tree)))


def check_memory(plan: MemoryPlan, *, allow: bool = False) -> None:
    """Raises MemoryPlanError (before any state is allocated) when the plan does not fit."""
    if plan.fits() or allow or os.environ.get("FEDJAX_PFL_SKIP_MEMORY_CHECK"):
        return
    limit = plan.max_clients()
    # The working set can grow with N too (PGFed's α rows): then no smaller N is "about" right.
    fit = (f"it would fit with about {limit:,} clients" if limit else
           f"the working set alone ({max(plan.working_set, plan.eval_working_set) / 2**30:.1f} GiB "
           "per device) leaves no room")
    raise MemoryPlanError(
        f"the run needs about {plan.total / 2**30:.1f} GiB but {plan.available / 2**30:.1f} GiB "
        f"is available ({plan.num_clients} clients, {plan.state_per_client / 2**20:.2f} MB of "
        f"state per client); {fit}. Lower --clients, store "
        "client state in half the memory with --state-dtype bfloat16, use more devices, or lower "
        "--chunk-size / --eval-batch-size for a smaller working set")


def memory_plan(abstract_state, num_clients: int, mesh, *, compiled: tuple, state_sizes: dict,
                data_bytes: int, data_whole: int, data_placement: str, state_placement: str,
                is_compiled: bool, frozen_bytes: int = 0) -> MemoryPlan:
    """A program's bytes per device (`core.Program.memory_plan`): its client state (resident
    rows sharded over the devices, or under host state placement the world's rows, `state_sizes`
    of the state placement), the data on each device (`data_bytes`), and the XLA temporaries of
    the `compiled` (round, evaluation), where compiled; a model's frozen parameters
    (`frozen_bytes`) once per device, whatever the number of clients."""
    from fedjax_pfl.core import layout

    devices = 1 if mesh is None else mesh.size
    per_client, replicated = layout.client_state_bytes(abstract_state, itemsize)
    working, evaluating = (
        int(analysis.temp_size_in_bytes) if analysis is not None else 0
        for analysis in (c.memory_analysis() if c is not None else None for c in compiled))
    platform = jax.local_devices()[0].platform
    client_per_device = int(per_client) * num_clients // devices
    host_row, world = state_sizes.get("host_row", 0), state_sizes.get("world", 0)
    if state_sizes:                  # on the devices: resident rows (sharded) and the world
        per_client = int(per_client) - host_row
        client_per_device = int(per_client) * num_clients // devices + world * host_row
    local = devices if mesh is None else sum(
        d.process_index == jax.process_index() for d in mesh.devices.flat)
    return MemoryPlan(
        devices=devices, platform=platform, num_clients=num_clients,
        state_per_client=int(per_client), client_state_per_device=client_per_device,
        replicated_state=int(replicated), data=data_bytes, working_set=working,
        eval_working_set=evaluating, available=available_memory(platform),
        local_devices=int(local), data_placement=data_placement, data_whole=data_whole,
        compiled=is_compiled, state_placement=state_placement, host_row_bytes=host_row,
        world_rows=world, staging_rows=state_sizes.get("staging", 0), frozen=int(frozen_bytes))
