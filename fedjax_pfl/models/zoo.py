"""The models by name: `models.get(name, input_shape, num_classes, ...)`, what `--model` picks."""

from __future__ import annotations

from typing import Sequence

from fedjax_pfl.models import cp, layers, nets, resnet_reddi, sequence
from fedjax_pfl.models.model import Model, from_flax
from fedjax_pfl.models.tasks import Task

MODELS: tuple[str, ...] = ("mlp", "logreg", "cnn", "vgg8", "resnet9", "resnet18", "cp_mlp", "cp_vgg8",
                           "resnet18_reddi",  # Reddi et al. 2021's CIFAR-100 ResNet (models/resnet_reddi.py)
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
    networks with GroupNorm; resnet18_reddi: Reddi et al. 2021's CIFAR-100 ResNet-18 (ResNet v2,
    7×7/2 stem and 3×3/2 max pool, GroupNorm 32, stages at stride 1; models/resnet_reddi.py, whose
    widths are fixed, so `width` and `norm` do not apply); cp_mlp / cp_vgg8: TDPFed's CP-DNN /
    CP-VGG8, every weight tensor as CP factors with ranks for compression rate `cr`
    (models/cp.py; cr = 1 is the dense model).
    `conv` picks how convolutions are computed (layers.CONV_IMPLS: "auto", "im2col",
    "winograd"; see layers.conv2d); the function is the same up to float rounding.

    `task` (a `models.tasks.Task`, e.g. `FederatedData.task`): what a natural dataset predicts;
    None is image or feature classification. The text models (char_lstm, word_lstm, transformer,
    tag_logreg, sent_lstm) and femnist_cnn are `models/sequence.py`'s, with the task's loss,
    weight and metric (`models/tasks.py`); `options` sets their sizes (e.g. {"hidden": 64}).
    """
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
    elif name in ("cnn", "resnet9", "resnet18", "resnet18_reddi"):
        if len(input_shape) != 3:
            raise ValueError(f"--model {name} needs image inputs [H, W, C], got shape {input_shape}")
        if name == "cnn":
            if min(input_shape[:2]) < 16:
                raise ValueError(
                    f"--model cnn needs images of at least 16x16 (two 5x5 valid convs and two "
                    f"2x2 pools), got {input_shape[0]}x{input_shape[1]}; use --model mlp"
                )
            module = nets.FedAvgCNN(num_classes, conv=conv)
        elif name == "resnet18_reddi":
            if width != 64 or norm != "group":
                raise ValueError(f"--model resnet18_reddi has the repository's fixed widths and "
                                 f"GroupNorm; width={width}, norm={norm!r} do not apply")
            module = resnet_reddi.ResNet18Reddi(num_classes, conv=conv)
        elif name == "resnet9":
            module = nets.ResNet9(num_classes, width=width, norm=norm, conv=conv)
        else:
            module = nets.ResNet18(num_classes, width=width, norm=norm, conv=conv)
    else:
        raise ValueError(f"unknown --model {name!r}; expected one of {MODELS}")
    return from_flax(module, input_shape, name=name)
