"""Models: pure init/apply/loss triples, and flax networks whose convs stay fast under vmap."""

from fedjax_pfl.models.layers import CONV_IMPLS, Conv2D, Dense, conv2d, conv2d_im2col, conv2d_winograd, max_pool_2x2
from fedjax_pfl.models.model import Model, from_flax, softmax_cross_entropy
from fedjax_pfl.models.nets import MLP, FedAvgCNN, ResNet9, ResNet18
from fedjax_pfl.models.resnet_reddi import ResNet18Reddi
from fedjax_pfl.models.zoo import MODELS, get

__all__ = [
    "CONV_IMPLS", "Conv2D", "Dense", "conv2d", "conv2d_im2col", "conv2d_winograd", "max_pool_2x2",
    "MODELS", "Model", "from_flax", "get", "softmax_cross_entropy", "MLP", "FedAvgCNN", "ResNet9",
    "ResNet18", "ResNet18Reddi",
]
