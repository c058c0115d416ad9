"""`Model`: the init/apply/loss triple every algorithm is written against.

Algorithms never see flax. Any flax module (via `from_flax`) or any hand-written pair of pure
functions works, so a notebook user can bring their own model:

    model = Model(init=lambda key: {"w": jnp.zeros((64, 10))},
                  apply=lambda p, x: x.reshape(len(x), -1) @ p["w"],
                  loss=softmax_cross_entropy)
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_pfl.models import layers, nets

Params = Any


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy −log softmax(logits)[label]; [B, C], [B] -> [B]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


class Model(NamedTuple):
    """A model as pure functions.

    init:   key -> params (a pytree of float arrays).
    apply:  (params, x [B, ...]) -> outputs [B, ...] (logits for classifiers). x is float32, or
            int32 token ids for models that embed their inputs.
    loss:   (outputs [B, ...], labels [B, ...]) -> [B]: each example's loss, summed over the units
            it counts (its tokens, for a sequence model). The engine masks padded examples.
    name:   for logs.
    weight: labels [B, ...] -> [B], the units each example counts (its real tokens); None: one
            each. A batch's mean loss is Σ_b m_b ℓ_b / max(Σ_b m_b w_b, 1) for the mask m.
    metric: (outputs, labels) -> (hits [B], count [B]): each example's correct units and the units
            scored (accuracy = Σ hits / Σ count: token accuracy, recall@k); None: argmax == label,
            one each.
    features: (params, x [B, ...]) -> z: the representation, the input of the head (the last
            Dense layer, `core.split.head_pattern`), e.g. [B, 100] for the MLP, [B, T, H] for a
            per-token model; `from_flax` and the sequence models fill it (`head_input`); None: a
            hand-written model without one (MOON needs it).
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]
    loss: Callable[[jax.Array, jax.Array], jax.Array] = softmax_cross_entropy
    name: str = "model"
    weight: Callable[[jax.Array], jax.Array] | None = None
    metric: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None
    features: Callable[[Params, jax.Array], jax.Array] | None = None


def head_input(module: nn.Module, params_template: Params
               ) -> Callable[[Params, jax.Array], jax.Array]:
    """features(params, x) = z, the input of `module`'s head: the first positional argument of the
    first call of the submodule that `core.split.head_pattern(params_template)` selects (the last
    Dense layer), recorded with `flax.linen.intercept_methods` while the module runs on x. Generic:
    no per-model code. The head's own computation is dead code that XLA removes under jit;
    `features.with_outputs(params, x)` gives (apply(params, x), z) from one forward pass.

    A model whose head is the whole module (logistic regression; head_pattern's `^[^/]*$` for
    top-level parameters) gets its input x. Raises ValueError at trace time if the head is never
    called (e.g. its parameters are used through another method than `__call__`).
    """
    from fedjax_pfl.core import split as split_lib   # lazily: fedjax_pfl.core imports this module

    pattern = re.compile(split_lib.head_pattern(params_template))

    def is_head(module_path: tuple[str, ...]) -> bool:
        # "Dense_1/" for the submodule Dense_1 (the pattern is "^Dense_1/"); "" for the root.
        return pattern.search("/".join(module_path) + "/" if module_path else "") is not None

    def outputs_and_features(params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        captured = []

        def record(next_fun, args, kwargs, context):
            if (not captured and context.method_name == "__call__" and args
                    and is_head(tuple(context.module.path))):
                captured.append(args[0])
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            outputs = module.apply({"params": params}, x)
        if not captured:
            raise ValueError(f"{type(module).__name__}: its head (parameters matching "
                             f"{pattern.pattern!r}) was never called, so it has no representation")
        return outputs, captured[0]

    def features(params: Params, x: jax.Array) -> jax.Array:
        return outputs_and_features(params, x)[1]

    # (apply(params, x), features(params, x)) from ONE forward pass, for a loss on both (MOON):
    # XLA does not merge two traced copies of the body, so calling both costs the body twice.
    features.with_outputs = outputs_and_features
    return features


def from_flax(
    module: nn.Module,
    input_shape: Sequence[int],
    *,
    loss: Callable[[jax.Array, jax.Array], jax.Array] = softmax_cross_entropy,
    name: str | None = None,
) -> Model:
    """Wraps a stateless flax.linen module (only a 'params' collection) as a `Model`.

    Raises ValueError for modules with mutable collections such as BatchNorm's 'batch_stats':
    the engine's client state holds trainable parameters only (use GroupNorm, see models/nets.py).
    """
    input_shape = tuple(int(s) for s in input_shape)
    variables = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, *input_shape)))
    extra = sorted(set(variables) - {"params"})
    if extra:
        raise ValueError(
            f"{type(module).__name__} has non-parameter collections {extra}; the engine supports "
            "stateless modules only (replace BatchNorm by GroupNorm or LayerNorm)"
        )

    def init(key: jax.Array) -> Params:
        return module.init(key, jnp.zeros((1, *input_shape), jnp.float32))["params"]

    def apply(params: Params, x: jax.Array) -> jax.Array:
        return module.apply({"params": params}, x)

    return Model(init=init, apply=apply, loss=loss, name=name or type(module).__name__,
                 features=head_input(module, variables["params"]))


MODELS: tuple[str, ...] = ("mlp", "logreg", "cnn", "vgg8", "resnet9", "resnet18", "cp_mlp", "cp_vgg8",
                           # natural-dataset models (models/sequence.py): text and FEMNIST
                           "char_lstm", "word_lstm", "transformer", "tag_logreg", "sent_lstm",
                           "femnist_cnn")


def get(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden: Sequence[int] = (100,),
    width: int = 64,
    norm: str = "group",
    cr: float = 2.0,
    conv: str = "auto",
    task=None,
    options: dict | None = None,
) -> Model:
    """A named model for inputs of `input_shape` (without the batch axis).

    mlp: Flatten-Dense(hidden...)-Dense(C) (784-100-10 on MNIST, pFedMe/TDPFed);
    logreg: multinomial logistic regression; cnn: the FedAvg CNN of the PGFed code (needs at
    least 16×16 images); vgg8: TDPFed's VGG8 (32×32 images); resnet9 / resnet18: pFedSOP's
    networks with GroupNorm; cp_mlp / cp_vgg8: TDPFed's CP-DNN / CP-VGG8, every weight tensor as
    CP factors with ranks for compression rate `cr` (models/cp.py; cr = 1 is the dense model).
    `conv` picks how convolutions are computed (layers.CONV_IMPLS: "auto", "im2col",
    "winograd"; see layers.conv2d); the function is the same up to float rounding.

    `task` (a `data.natural.Task`, e.g. `FederatedData.task`): what a natural dataset predicts;
    None is image or feature classification. The text models (char_lstm, word_lstm, transformer,
    tag_logreg, sent_lstm) and femnist_cnn are `models/sequence.py`'s, with the task's loss,
    weight and metric (`models/tasks.py`); `options` sets their sizes (e.g. {"hidden": 64}).
    """
    from fedjax_pfl.models import cp, sequence
    from fedjax_pfl.data.natural import Task

    input_shape = tuple(int(s) for s in input_shape)
    if conv not in layers.CONV_IMPLS:
        raise ValueError(f"--conv must be one of {list(layers.CONV_IMPLS)}, got {conv!r}")
    options = dict(options or {})
    if name in sequence.SEQUENCE_MODELS:
        if task is None:   # an image dataset without a Task: one label per image
            task = Task(kind="classify", num_classes=num_classes, inputs="image")
        if name == "femnist_cnn":
            options.setdefault("conv", conv)
        return Model(**sequence.get(name, task, input_shape, **options))
    if options:
        raise ValueError(f"--model {name} takes no model options, got {sorted(options)}")
    if task is not None and (task.inputs == "tokens" or task.kind != "classify"):
        raise ValueError(f"--model {name} classifies images or features; this dataset is a "
                         f"{task.kind} task of {task.inputs} inputs (use --model "
                         f"{task.default_model or 'char_lstm'})")
    if name in ("cp_mlp", "cp_vgg8") and cr == 1:
        name = name[3:]  # CR ×1: no decomposition
    if name == "mlp":
        module = nets.MLP(num_classes, tuple(hidden))
    elif name == "logreg":
        module = nets.MLP(num_classes, ())
    elif name == "cp_mlp":
        module = cp.CPMLP(num_classes, tuple(hidden), cr=cr)
    elif name in ("vgg8", "cp_vgg8"):
        if len(input_shape) != 3 or min(input_shape[:2]) < 32:
            raise ValueError(f"--model {name} needs images of at least 32x32 (five 2x2 pools), "
                             f"got shape {input_shape}; use --model mlp or cnn")
        module = (nets.VGG8(num_classes, conv=conv) if name == "vgg8"
                  else cp.CPVGG8(num_classes, cr=cr, conv=conv))
    elif name in ("cnn", "resnet9", "resnet18"):
        if len(input_shape) != 3:
            raise ValueError(f"--model {name} needs image inputs [H, W, C], got shape {input_shape}")
        if name == "cnn":
            if min(input_shape[:2]) < 16:
                raise ValueError(
                    f"--model cnn needs images of at least 16x16 (two 5x5 valid convs and two "
                    f"2x2 pools), got {input_shape[0]}x{input_shape[1]}; use --model mlp"
                )
            module = nets.FedAvgCNN(num_classes, conv=conv)
        elif name == "resnet9":
            module = nets.ResNet9(num_classes, width=width, norm=norm, conv=conv)
        else:
            module = nets.ResNet18(num_classes, width=width, norm=norm, conv=conv)
    else:
        raise ValueError(f"unknown --model {name!r}; expected one of {MODELS}")
    return from_flax(module, input_shape, name=name)
