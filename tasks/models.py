"""Models by name.

All are Opacus-compatible: no BatchNorm, only layers Opacus computes per-sample gradients for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import ConfigError
from .registry import MODELS, auto_model


def _pair(v: int | tuple[int, ...]) -> list[int]:
    return list(v) if isinstance(v, tuple) else [v, v]


class _ChannelsLastPool(torch.autograd.Function):
    """Max-pooling of an NCHW tensor, computed (both ways) on a channels-last copy; the
    input gradient comes back NCHW, so the layers around it stay on their fast kernels.
    (Not for torch.func transforms: :class:`MaxPool2d` leaves them torch's own pooling.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, args: tuple) -> torch.Tensor:
        last = x.contiguous(memory_format=torch.channels_last)
        out, indices = torch.ops.aten.max_pool2d_with_indices(last, *args)
        ctx.args = args
        ctx.save_for_backward(last, indices)
        return out.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        last, indices = ctx.saved_tensors
        grad_x = torch.ops.aten.max_pool2d_with_indices_backward(
            grad.contiguous(memory_format=torch.channels_last), last, *ctx.args, indices)
        return grad_x.contiguous(), None


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` computed in channels-last layout on the CPU: the same outputs and
    gradients bit for bit (a maximum is exact; ties go to the same first index), and a
    small-CNN step 2.5 -> 1.5 ms (batch 32, one thread), torch's NCHW CPU kernel being
    slow for these shapes. Inside torch.func transforms (vmap has no channels-last
    layout) and off the CPU it is ``nn.MaxPool2d`` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch._C._are_functorch_transforms_active() or x.device.type != "cpu"
                or x.dim() != 4 or x.shape[1] < 16 or self.return_indices
                or x.is_contiguous(memory_format=torch.channels_last)):
            return super().forward(x)
        stride = self.stride if self.stride is not None else self.kernel_size
        return _ChannelsLastPool.apply(x, (_pair(self.kernel_size), _pair(stride),
                                           _pair(self.padding), _pair(self.dilation),
                                           self.ceil_mode))


class McMahanCNN(nn.Module):
    """The CNN of McMahan et al. 2017 (FedAvg paper): 5x5x32, 5x5x64 (each + 2x2 max-pool), FC512.

    For 28x28x1 input it has exactly 1,663,370 parameters, as in the paper.
    """

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), MaxPool2d(2),
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
            nn.Conv2d(c, 16, 8, stride=2, padding=3), nn.ReLU(), MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(), MaxPool2d(2, 1),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, *in_shape)).shape[1]
        self.classifier = nn.Sequential(nn.Linear(flat, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def mlp_net(in_features: int, hidden: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """A ReLU MLP (McMahan's 2NN is hidden=(200, 200)); flattens its input first."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def resnet18_gn(in_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with GroupNorm (DP-friendly) and a CIFAR stem (3x3, no max-pool).

    The residual blocks add without in-place ops: Opacus' backward hooks cannot follow
    torchvision's ``out += identity`` and in-place ReLU.
    """
    from torchvision.models.resnet import BasicBlock, ResNet  # lazy: 2 s of imports

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


class CharRNN(nn.Module):
    """A next-character model: an embedding, a stack of LSTM or GRU layers, and a linear
    layer on the last step's output. LEAF's Shakespeare baseline (Caldas et al. 2018) is
    an 8-dimensional embedding and two LSTM layers of 256. DP-SGD trains it through
    recurrent layers built of Linear layers (:func:`privacy.dp.dpsgd.make_private` swaps
    them in: :mod:`privacy.dp.recurrent` under book-keeping, Opacus' DPLSTM/DPGRU under
    its own modes)."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, cell: str) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](embed, hidden, layers,
                                                          batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(x))
        return self.head(out[:, -1])


class _EncoderBlock(nn.Module):
    """A pre-norm transformer block (Vaswani et al. 2017) built from Linear and LayerNorm
    only, the layers Opacus has per-sample gradients for (torch's MultiheadAttention has
    none): self-attention over the whole window, then a two-layer MLP."""

    def __init__(self, width: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ff = nn.Sequential(nn.Linear(width, ff), nn.GELU(), nn.Linear(ff, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        att = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, w))
        return x + self.ff(self.norm2(x))


class CharTransformer(nn.Module):
    """A next-character transformer: token embedding plus fixed sinusoidal positions, a
    stack of :class:`_EncoderBlock`, and a linear layer on the last position. The window is
    all input (the label is the character after it), so attention needs no causal mask."""

    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int,
                 ff: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        pos = torch.arange(length, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32)
                         * (-np.log(10000.0) / width))
        table = torch.zeros(length, width)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.register_buffer("positions", table, persistent=False)
        self.blocks = nn.Sequential(*(_EncoderBlock(width, heads, ff) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embedding(x) + self.positions[: x.shape[1]])
        return self.head(self.norm(h[:, -1]))


def _text_shape(name: str, input_shape: tuple[int, ...]) -> int:
    if len(input_shape) != 1:
        raise ConfigError(f"model {name!r} reads sequences of token ids, but the dataset gives "
                          f"inputs of shape {input_shape}. Use it with dataset = 'shakespeare'.")
    return input_shape[0]


def char_lstm(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = ()
              ) -> nn.Module:
    """LEAF's Shakespeare model: embedding 8, two LSTM layers of 256 (about 820k weights)."""
    _text_shape("char-lstm", input_shape)
    return CharRNN(num_classes, 8, 256, 2, "lstm")


def char_gru(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = ()
             ) -> nn.Module:
    """A small next-character model for 2 cores: embedding 8, one GRU layer of 128."""
    _text_shape("char-gru", input_shape)
    return CharRNN(num_classes, 8, 128, 1, "gru")


def char_transformer(input_shape: tuple[int, ...], num_classes: int,
                     hidden: tuple[int, ...] = ()) -> nn.Module:
    """A small transformer for 2 cores: width 64, two blocks of 4 heads, MLP 128 (about 77k
    weights); DP-SGD trains it with Opacus' own Linear/LayerNorm/Embedding samplers."""
    return CharTransformer(num_classes, _text_shape("char-transformer", input_shape), 64, 2,
                           4, 128)


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(
            f"model {name!r} needs image input (channels, height, width) but the dataset "
            f"gives vectors of shape {input_shape}. Use model = 'mlp' for tabular data.")
    if min(input_shape[1:]) < 16:
        raise ConfigError(f"model {name!r} needs images of at least 16x16, got {input_shape}.")
    return input_shape  # type: ignore[return-value]


# The registered models (tasks.registry.MODELS): (input shape, classes, MLP widths) -> module.

def mcmahan_cnn(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = ()
                ) -> nn.Module:
    return McMahanCNN(_image_shape("cnn", input_shape), num_classes)


def small_cnn(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = ()
              ) -> nn.Module:
    return SmallCNN(_image_shape("small-cnn", input_shape), num_classes)


def resnet18(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = ()
             ) -> nn.Module:
    return resnet18_gn(_image_shape("resnet18", input_shape), num_classes)


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (200, 200)
        ) -> nn.Module:
    return mlp_net(int(np.prod(input_shape)), hidden, num_classes)


def linear(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = ()
           ) -> nn.Module:
    """A linear probe (an MLP without hidden layers)."""
    return mlp_net(int(np.prod(input_shape)), (), num_classes)


# Trunks for frozen embedding networks (tasks.registry.BACKBONES): the model without its
# classifier, built whole first so that a seeded trunk is initialised as the model is.

def mcmahan_cnn_trunk(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return mcmahan_cnn(input_shape, num_classes).features


def small_cnn_trunk(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return small_cnn(input_shape, num_classes).features


def resnet18_trunk(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    net = resnet18(input_shape, num_classes)
    net.fc = nn.Identity()
    return net


def resolve_model_name(name: str, input_shape: tuple[int, ...], kind: str = "image") -> str:
    """Turn 'auto' into a concrete model for the input shape and kind of data."""
    return auto_model(input_shape, kind) if name == "auto" else name


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int,
                hidden: tuple[int, ...] = (200, 200), kind: str = "image") -> nn.Module:
    """Build a registered model (or 'auto') for inputs of ``input_shape`` (no batch dim)."""
    return MODELS.load(resolve_model_name(name, input_shape, kind))(input_shape, num_classes,
                                                                     hidden)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
