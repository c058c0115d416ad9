"""What is per-client in an algorithm's state, and the device mesh the client axis is split over.

Per-client state is what an algorithm's state DECLARES as such: a NamedTuple state class lists
its per-client fields in a class attribute,

    class State(NamedTuple):
        params: Params        # global model                   leaves [...]
        personal: Params      # one model per client           leaves [N, ...]
        CLIENT_FIELDS = ("personal",)

and every leaf under a declared field has leading axis N (all clients). Nothing is inferred
from shapes: a global [10] output bias in a run of N = 10 clients stays a global leaf
(replicated, never cast to the storage dtype). Undeclared states have no per-client leaves.

A state class may also declare `SPLIT_FIELDS`: leaves that are not per-client rows but whose
leading axis is split over the devices like the clients' (a sweep's runs, each device holding
whole runs: `fedjax_pfl.sweep`); they stay on the devices under every state placement.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

Params = Any
AXIS = "clients"


def client_mesh() -> Mesh | None:
    """A 1-D mesh ("clients") over all devices (of every process), or None with a single one."""
    devices = jax.devices()
    return Mesh(np.array(devices), ("clients",)) if len(devices) > 1 else None


def _is_state_class(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def client_mask(tree: Params, num_clients: int | None = None) -> Params:
    """A pytree of bools shaped like `tree`'s leaves: True for the leaves under a field that a
    NamedTuple node of `tree` declares in its `CLIENT_FIELDS` (at any depth).

    With `num_clients`, every declared leaf must have leading axis `num_clients`; a ValueError
    names the field otherwise (an algorithm's declaration and its state disagree). Works on
    abstract trees (jax.ShapeDtypeStruct leaves).
    """
    def mark(node, field_path: str, declared: bool):
        if declared:
            if num_clients is not None:
                for leaf in jax.tree.leaves(node):
                    shape = getattr(leaf, "shape", ())
                    if len(shape) < 1 or shape[0] != num_clients:
                        raise ValueError(f"state field {field_path} is declared per-client "
                                         f"(CLIENT_FIELDS) but has a leaf of shape {tuple(shape)}, "
                                         f"not [{num_clients}, ...]")
            return jax.tree.map(lambda _: True, node)
        if _is_state_class(node):
            fields = getattr(type(node), "CLIENT_FIELDS", ())
            unknown = set(fields) - set(node._fields)
            if unknown:
                raise ValueError(f"{type(node).__name__}.CLIENT_FIELDS names {sorted(unknown)}, "
                                 f"which are not among its fields {list(node._fields)}")
            return type(node)(*(mark(v, f"{type(node).__name__}.{name}", name in fields)
                                for name, v in zip(node._fields, node)))
        if isinstance(node, (list, tuple)):
            return type(node)(mark(v, f"{field_path}[{i}]", False) for i, v in enumerate(node))
        if isinstance(node, dict):
            return type(node)((k, mark(v, f"{field_path}[{k!r}]", False)) for k, v in node.items())
        return jax.tree.map(lambda _: False, node)

    return mark(tree, "state", False)


def split_mask(tree: Params) -> Params:
    """A pytree of bools shaped like `tree`'s leaves: True under the fields a NamedTuple node
    declares in its `SPLIT_FIELDS` (module docstring)."""
    def mark(node, declared: bool):
        if declared:
            return jax.tree.map(lambda _: True, node)
        if _is_state_class(node):
            fields = getattr(type(node), "SPLIT_FIELDS", ())
            return type(node)(*(mark(v, name in fields) for name, v in zip(node._fields, node)))
        if isinstance(node, (list, tuple)):
            return type(node)(mark(v, False) for v in node)
        if isinstance(node, dict):
            return type(node)((k, mark(v, False)) for k, v in node.items())
        return jax.tree.map(lambda _: False, node)

    return mark(tree, False)


def client_shardings(tree: Params, mesh: Mesh, num_clients: int | None = None) -> Params:
    """Shardings for a state pytree: declared per-client leaves (`client_mask`) and split
    leaves (`split_mask`) split along the client axis over the mesh, every other leaf
    replicated. N must be a multiple of the device count (`FederatedData.pad_clients`). Works
    on abstract trees (eval_shape)."""
    rows = NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
    whole = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda _, is_client, is_split: rows if is_client or is_split else whole,
                        tree, client_mask(tree, num_clients), split_mask(tree))


def cast_leaf(x, dtype):
    """One float leaf (array or abstract shape) in `dtype`; other leaves unchanged."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):                     # abstract shapes (memory plans)
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)


def cast_client_leaves(tree: Params, dtype, num_clients: int | None = None) -> Params:
    """Declared per-client float leaves stored as `dtype` (e.g. bfloat16 for --state-dtype);
    other leaves unchanged. `clients.gather` returns such rows as float32 again."""
    return jax.tree.map(lambda x, c: cast_leaf(x, dtype) if c else x,
                        tree, client_mask(tree, num_clients))


def client_state_bytes(tree: Params, itemsize) -> tuple[int, int]:
    """(bytes of one client's rows, bytes of everything else) of an abstract state tree."""
    per_client = replicated = 0
    for x, is_client in zip(jax.tree.leaves(tree), jax.tree.leaves(client_mask(tree))):
        if is_client:
            per_client += int(np.prod(x.shape[1:])) * itemsize(x.dtype)
        else:
            replicated += int(np.prod(x.shape)) * itemsize(x.dtype)
    return per_client, replicated


def host_mask(tree: Params, client_mask: Params) -> Params:
    """True on the per-client leaves that wait on the host: those of `client_mask` less the
    fields a state class keeps on the devices (`DEVICE_CLIENT_FIELDS`: small per-client arrays a
    round reads for every client, such as PGFed's α row sums)."""
    def mark(node, mask):
        if isinstance(node, tuple) and hasattr(type(node), "_fields"):
            keep = set(getattr(type(node), "DEVICE_CLIENT_FIELDS", ()))
            return type(node)(*(jax.tree.map(lambda _: False, m) if name in keep else mark(v, m)
                                for name, v, m in zip(node._fields, node, mask)))
        if isinstance(node, (list, tuple)):
            return type(node)(mark(v, m) for v, m in zip(node, mask))
        if isinstance(node, dict):
            return type(node)((k, mark(v, mask[k])) for k, v in node.items())
        return mask

    return mark(tree, client_mask)


def context_mesh():
    """The mesh the client axis is split over in the current trace (the context's, `jax.set_mesh`,
    which `core.Program` enters around its calls), or None: no mesh, one device, or a
    computation already split over that axis by hand (a sweep's runs, each on its own device).
    The client mapper and `Engine.sample` read it, so building an algorithm binds no device
    layout (DrJAX reads its placements from the context the same way)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names or AXIS in mesh.manual_axes:
        return None
    return mesh if mesh.size > 1 else None


def mesh_devices() -> int:
    """The devices the client axis is split over in the current trace (`context_mesh`): 1
    without one."""
    mesh = context_mesh()
    return 1 if mesh is None else int(mesh.size)


class InMesh:
    """A jitted (or lowered, or compiled) function called, lowered and compiled within a mesh
    context (`context()`: `jax.set_mesh` of the program's mesh, `core.Program`), where the
    client mapper and sampling read it (`context_mesh`)."""

    def __init__(self, fn, context: Callable):
        self._fn, self._context = fn, context

    def __call__(self, *args, **kwargs):
        with self._context():
            return self._fn(*args, **kwargs)

    @property
    def unwrapped(self):
        """The function itself, for a caller already within the mesh (tracing under it)."""
        return self._fn

    def lower(self, *args, **kwargs) -> "InMesh":
        with self._context():
            return InMesh(self._fn.lower(*args, **kwargs), self._context)

    def compile(self, *args, **kwargs) -> "InMesh":
        with self._context():
            return InMesh(self._fn.compile(*args, **kwargs), self._context)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._fn, name)     # (memory_analysis, as_text, … of the wrapped stage)
