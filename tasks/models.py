"""Models by name.

All are Opacus-compatible: no BatchNorm, only layers Opacus computes per-sample gradients for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .config import ConfigError, parse_hidden


class McMahanCNN(nn.Module):
    """The CNN of McMahan et al. 2017 (FedAvg paper): 5x5x32, 5x5x64 (each + 2x2 max-pool), FC512.

    For 28x28x1 input it has exactly 1,663,370 parameters, as in the paper.
    """

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(64 * (h // 4) * (w // 4), 512), nn.ReLU(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SmallCNN(nn.Module):
    """Opacus' MNIST example network (SampleConvNet, 26k parameters for 28x28 input).

    Small and fast, and the model behind the Opacus MNIST DP-SGD anchors.
    """

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c = in_shape[0]
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 8, stride=2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, *in_shape)).shape[1]
        self.classifier = nn.Sequential(nn.Linear(flat, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def mlp(in_features: int, hidden: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """A ReLU MLP (McMahan's 2NN is hidden=(200, 200)); flattens its input first."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def resnet18(in_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with GroupNorm (DP-friendly) and a CIFAR stem (3x3, no max-pool).

    The residual blocks add without in-place ops: Opacus' backward hooks cannot follow
    torchvision's ``out += identity`` and in-place ReLU.
    """
    from torchvision.models.resnet import BasicBlock, ResNet

    class Block(BasicBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x if self.downsample is None else self.downsample(x)
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + identity)

    model = ResNet(Block, [2, 2, 2, 2], num_classes=num_classes,
                   norm_layer=lambda ch: nn.GroupNorm(min(32, ch), ch))
    model.conv1 = nn.Conv2d(in_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    model.relu = nn.ReLU(inplace=False)
    return model


def resolve_model_name(name: str, input_shape: tuple[int, ...]) -> str:
    """Turn 'auto' into a concrete model for the input shape."""
    if name != "auto":
        return name
    if len(input_shape) == 1:
        return "mlp"
    return "resnet18" if input_shape[-1] >= 32 else "small-cnn"


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int,
                mlp_hidden: str = "200,200") -> nn.Module:
    """Build a model by name for inputs of ``input_shape`` (without the batch dimension)."""
    name = resolve_model_name(name, input_shape)
    if name == "linear":  # a linear probe
        return mlp(int(np.prod(input_shape)), (), num_classes)
    if name == "mlp":
        in_features = 1
        for d in input_shape:
            in_features *= d
        return mlp(in_features, parse_hidden(mlp_hidden), num_classes)
    if len(input_shape) != 3:
        raise ConfigError(
            f"model {name!r} needs image input (channels, height, width) but the dataset "
            f"gives vectors of shape {input_shape}. Use model = 'mlp' for tabular data."
        )
    if min(input_shape[1:]) < 16:
        raise ConfigError(f"model {name!r} needs images of at least 16x16, got {input_shape}.")
    if name == "cnn":
        return McMahanCNN(input_shape, num_classes)  # type: ignore[arg-type]
    if name == "small-cnn":
        return SmallCNN(input_shape, num_classes)  # type: ignore[arg-type]
    if name == "resnet18":
        return resnet18(input_shape, num_classes)  # type: ignore[arg-type]
    raise ConfigError(f"unknown model {name!r}; choose cnn, small-cnn, resnet18 or mlp.")


def model_for(cfg: Mapping[str, Any]) -> tuple[nn.Module, str]:
    """The model a run config asks for, sized for what the clients train on."""
    from .splits import dataset_for, feature_shape

    shape = feature_shape(cfg)
    name = resolve_model_name(str(cfg["model"]), shape)
    return build_model(name, shape, dataset_for(cfg).num_classes, str(cfg["mlp-hidden"])), name


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
