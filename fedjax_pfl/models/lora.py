"""LoRA as a model transformation: a frozen base, low-rank adapters as the trained parameters.

LoRA (Hu et al., ICLR 2022, eq. 3) replaces a dense layer's y = x W + b by

    y = x W + b + (α/r) · dropout(x) Aᵀ Bᵀ,        A [r, d_in], B [d_out, r], W [d_in, d_out]

with W and b frozen and only A and B trained. `lora(model, base, example, targets=..., rank=r,
alpha=α)` returns a `Model` whose parameters are the adapters alone,

    {module path...: {"lora_A": [r, d_in], "lora_B": [d_out, r]}}   (PEFT's shapes: nn.Linear
                                                                    weights are [out, in])

nested like the flax module tree (the MLP's "Dense_0/lora_A"), and whose `frozen` is the base
(`models.frozen`): every compiled program takes it as one replicated input, so a cohort's
adapters are one stacked pytree trained in one vectorised step over one copy of the base.

The forward pass runs the base model unchanged under `flax.linen.intercept_methods`: each call
of a targeted dense module returns its own output plus the low-rank term, computed from the
call's input, so W + (α/r)BA is never formed (per client it would be a copy of the base).

Initialisation as PEFT's (`peft.tuners.lora.layer.LoraLayer.reset_lora_parameters`, "default"):
A by `torch.nn.init.kaiming_uniform_(a=√5)` of an [r, d_in] weight, i.e. U(−1/√d_in, 1/√d_in);
B = 0, so the adapted model starts as the base model exactly. Dropout (PEFT's `lora_dropout`)
acts on the adapter's input only, in training (a key bound by local training,
`models.model.training_key`); evaluation is deterministic.

A dense module is any flax module whose parameters hold a 2-D `kernel` [d_in, d_out] (flax's
`nn.Dense`, our `layers.Dense`); the targets are matched against their paths ("/"-joined): a
target names a module whose path is it or ends with "/" + it (PEFT's `target_modules` rule), or
"all" for every dense module.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_pfl.models import model as model_lib
from fedjax_pfl.models.frozen import Frozen
from fedjax_pfl.models.model import Model

Params = Any
LORA_A, LORA_B = "lora_A", "lora_B"


class LoraConfig(NamedTuple):
    """The adapters' settings (PEFT's `LoraConfig` names): rank r, scale numerator α, the
    targeted dense modules' paths, dropout p on the adapters' input."""

    rank: int
    alpha: float
    targets: tuple[str, ...]     # the matched dense modules' full paths ("Block_0/qkv")
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        """α / r, the low-rank term's factor."""
        return self.alpha / self.rank


def _subtree(params: Params, path: tuple[str, ...]) -> Any:
    node = params
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def dense_layers(model: Model, base: Params, example: Any) -> dict[str, tuple[int, int]]:
    """{path: (d_in, d_out)} of the dense modules `model.apply(base, example)` calls, in call
    order: the modules whose parameters hold a 2-D `kernel` (module docstring). Traced with
    abstract values only (`jax.eval_shape`)."""
    found: dict[str, tuple[int, int]] = {}

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            path = tuple(context.module.path)
            node = _subtree(base, path)
            kernel = node.get("kernel") if isinstance(node, dict) else None
            if kernel is not None and getattr(kernel, "ndim", 0) == 2:
                found.setdefault("/".join(path), tuple(int(d) for d in kernel.shape))
        return next_fun(*args, **kwargs)

    spec = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
    with nn.intercept_methods(record):
        # (a fresh function: eval_shape's trace cache would skip the interceptor)
        jax.eval_shape(lambda p, x: model.apply(p, x), jax.tree.map(spec, base),
                       jax.tree.map(spec, example))
    return found


def match_targets(available: Sequence[str], targets: Sequence[str]) -> tuple[str, ...]:
    """The paths among `available` that `targets` name (module docstring), in `available`'s
    order. A target that names none is a ValueError listing the dense modules."""
    targets = tuple(targets)
    if not targets:
        raise ValueError("--lora-targets names no module")
    if "all" in targets:
        return tuple(available)
    chosen = []
    for target in targets:
        hits = [p for p in available if p == target or p.endswith("/" + target)]
        if not hits:
            raise ValueError(f"--lora-targets {target!r} names no dense module; the model's dense "
                             f"modules are {', '.join(available) or 'none'}")
        chosen.extend(hits)
    return tuple(p for p in available if p in set(chosen))


def init_adapters(key: jax.Array, layers: dict[str, tuple[int, int]], config: LoraConfig,
                  dtype=jnp.float32) -> Params:
    """The adapters at PEFT's default initialisation: A_l ~ U(−1/√d_in, 1/√d_in) (kaiming
    uniform, a = √5, of an [r, d_in] weight), each targeted layer l its own key (fold_in of
    its position among the targets); B_l = 0."""
    out: dict = {}
    for i, path in enumerate(config.targets):
        d_in, d_out = layers[path]
        bound = 1.0 / math.sqrt(d_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), (config.rank, d_in), dtype,
                               -bound, bound)
        node = out
        for part in path.split("/"):
            node = node.setdefault(part, {})
        node[LORA_A] = a
        node[LORA_B] = jnp.zeros((d_out, config.rank), dtype)
    return out


def adapter_of(adapters: Params, path: str) -> tuple[jax.Array, jax.Array]:
    """(A, B) of the layer at `path`."""
    node = _subtree(adapters, tuple(path.split("/")))
    return node[LORA_A], node[LORA_B]


def low_rank(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, *, dropout: float = 0.0,
             key: jax.Array | None = None) -> jax.Array:
    """(α/r) · dropout(x) Aᵀ Bᵀ for x [..., d_in]: [..., d_out], through the rank-r bottleneck
    (two thin products, never B A). Dropout: inverted (kept inputs ×1/(1−p)), where a key is
    given and p > 0."""
    x = x.astype(a.dtype)
    if dropout > 0.0 and key is not None:
        keep = jax.random.bernoulli(key, 1.0 - dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - dropout), 0.0)
    return scale * ((x @ a.T) @ b.T)


def lora(model: Model, base: Params, example: Any, *, targets: Sequence[str], rank: int,
         alpha: float, dropout: float = 0.0) -> tuple[Model, LoraConfig]:
    """`model` with LoRA adapters on the dense modules `targets` names (module docstring).

    Args:
      model: a `Model` whose apply(params, x) runs flax modules (`from_flax`, the zoo's).
      base: its (pretrained) parameters: frozen, the returned model's `frozen`.
      example: an input batch [B, ...] (or its shape and dtype) to trace the modules called.
      targets: module names or paths (PEFT's `target_modules`), or ["all"].
      rank, alpha, dropout: r ≥ 1, α > 0, p ∈ [0, 1).
    Returns:
      (the adapted `Model`: init(key) -> adapters, apply(adapters, x), the same loss, weight,
      metric; `features` None; the `LoraConfig`).
    """
    if int(rank) != rank or rank < 1:
        raise ValueError(f"--lora-rank must be an integer >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"--lora-alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {dropout!r}")
    layers = dense_layers(model, base, example)
    config = LoraConfig(int(rank), float(alpha), match_targets(list(layers), targets),
                        float(dropout))
    for path in config.targets:
        if config.rank > min(layers[path]):
            raise ValueError(f"--lora-rank {config.rank} exceeds {path}'s dimensions "
                             f"{layers[path]} (d_in, d_out)")
    frozen = Frozen(base)
    targeted = frozenset(config.targets)
    base_apply = model.apply

    def init(key: jax.Array) -> Params:
        return init_adapters(key, layers, config)

    def adapted_call(weighted: Sequence[tuple[Any, Params]], fn: Callable, x: jax.Array):
        """fn(base, x) with several adapters' low-rank terms added in every targeted layer, each
        scaled by its weight: y = x W + b + Σ_k w_k (α/r) dropout(x) A_kᵀ B_kᵀ. A weight is
        None (1), a scalar, or one per example [B] (FedDPA's instance-wise mixture)."""
        train_key = model_lib.current_training_key() if config.dropout > 0 else None
        calls = [0]

        def adapt(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.method_name != "__call__":
                return out
            path = "/".join(context.module.path)
            if path not in targeted:
                return out
            key = None
            if train_key is not None:     # one dropout mask per adapted call
                key = jax.random.fold_in(train_key, calls[0])
                calls[0] += 1
            for weight, adapters in weighted:
                a, b = adapter_of(adapters, path)
                delta = low_rank(args[0], a, b, config.scale, dropout=config.dropout, key=key)
                if weight is not None:
                    weight = jnp.asarray(weight)
                    if weight.ndim == 1:          # per example: over the batch axis
                        weight = weight.reshape(weight.shape + (1,) * (delta.ndim - 1))
                    delta = weight * delta
                out = out + delta.astype(out.dtype)
            return out

        with nn.intercept_methods(adapt):
            return fn(frozen.get(), x)

    def mix(weighted: Sequence[tuple[Any, Params]], x: jax.Array) -> jax.Array:
        """The adapted model's outputs with several weighted adapters (`adapted_call`; FedDPA's
        mixture of a global and a personal adapter, `algorithms.feddpa`)."""
        return adapted_call(weighted, base_apply, x)

    def apply(adapters: Params, x: jax.Array) -> jax.Array:
        return mix([(None, adapters)], x)

    # (the mixture of several adapters over one forward pass of the base, for FedDPA)
    apply.mix = mix
    if model.features is not None:
        # The base's representation (its `features`) under the adapters (FedDPA's similarity
        # of an input to a client's data); the adapted Model's own `features` stays None.
        apply.features = lambda adapters, x: adapted_call([(None, adapters)], model.features, x)

    adapted = model._replace(init=init, apply=apply, name=f"{model.name}+lora",
                             features=None, frozen=frozen,
                             train_key=config.dropout > 0)
    return adapted, config


def merged(base: Params, adapters: Params, config: LoraConfig) -> Params:
    """The base with each targeted kernel replaced by W + (α/r)(BA)ᵀ: [d_in, d_out] (the merged
    model of PEFT's `merge_and_unload`, in flax's kernel layout)."""
    out = jax.tree.map(lambda v: v, base)
    for path in config.targets:
        a, b = adapter_of(adapters, path)
        node = _subtree(out, tuple(path.split("/")))
        w = node["kernel"]
        node["kernel"] = (w + config.scale * (b @ a).T.astype(w.dtype)).astype(w.dtype)
    return out
