"""DP-SGD's per-sample clipping in one backward pass: book-keeping (Bu et al. 2023).

Opacus' ``hooks`` mode materializes every per-sample gradient (B copies of each weight:
9x plain SGD on the McMahan CNN, whose dense layer has 1.6M weights); its ghost
clipping computes per-sample norms without them but needs a second backward pass.
Book-keeping (Bu, Wang, Zha, Karypis, "Differentially Private Optimization on Large
Model at Small Cost", ICML 2023) keeps, per layer, the input activations ``a`` and the
gradients ``g`` of the layer's output from the one backward pass, and gets both the
per-sample norms and the clipped sum from them:

* ``Linear`` (2-d input): the per-sample weight gradient ``g_i a_i^T`` has norm
  ``|g_i| |a_i|`` (the ghost norm, Goodfellow 2015) and the clipped sum is
  ``(c * g)^T a``, one matrix product, never B copies of the weight;
* ``Linear`` on a sequence ``(B, T, in)`` or used more than once in a pass (the recurrent
  layers of :mod:`.recurrent` report each projection's inputs and output gradients once
  per sequence; Opacus' DPGRU/DPLSTM/DPRNN call each cell's layers at every time step):
  the per-sample gradient is ``G_i^T A_i`` over all its rows, one batched product (Opacus'
  hooks add one ``B x out x in`` product per step); when the ``B`` copies would be too large,
  the ghost norm of the sum, ``<A_i A_i^T, G_i G_i^T>`` (Li et al. 2022, "Large Language
  Models Can Be Strong Differentially Private Learners"), and the clipped sum as one
  matrix product;
* ``Embedding``: the ghost norm ``sum_{t,s} [x_t = x_s] <g_t, g_s>`` (never the ``B x
  vocab x dim`` copies) and the clipped sum added row by row into the table;
* ``LayerNorm`` and ``GroupNorm``: per-sample gradients (one number per channel),
  ``sum g * x_hat`` for the weight and ``sum g`` for the bias, with ``x_hat`` the input
  normalized again without the affine map;
* ``Conv2d``: the ghost norm (the Gram matrices of the unfolded input and the output
  gradients, Bu et al. 2023's mixed ghost clipping) where few output positions face
  many weights, the clipped sum one product over the batch; otherwise per-sample weight
  gradients by the cheaper exact way for the layer's shape: the unfolded input times the
  output gradients for a small output, else one grouped convolution's weight backward
  with an example in each group; the clipped sum is then their weighted sum.

The layers' own parameters do not require gradients during the pass (autograd computes
only what flows between layers; the first layer's output is the pass's leaf, so no
gradient of the input is computed), the noise, scaling and accounting are Opacus'
``DPOptimizer`` and accountant unchanged (the noise drawn in place, the same draws), and
an empty Poisson batch is a noise-only step as the analysis requires. Clipping factors
are Opacus' exactly: ``min(1, C / (|grad_i| + 1e-6))``. Only models whose trainable
parameters all belong to ``Linear``, ungrouped ``Conv2d``, plain ``Embedding``,
``LayerNorm`` and ``GroupNorm`` layers are supported, and torch's recurrent layers once
swapped for Opacus' (:func:`supports`), with no Parameter shared by two layers.

Like Opacus' hooks it assumes what every built-in model does: each layer's input is
batch-first (a first dimension other than the batch is refused; a sequence-first input
whose length happens to equal the batch cannot be told apart), and a trained Parameter
reaches the loss only through its own layer (one used directly, e.g. ``F.linear(h,
embedding.weight)``, would get no gradient: it is frozen during the pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from . import background
from .recurrent import SequenceRecurrent

_KINDS = (nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm)


def _layers(model: nn.Module) -> Iterator[nn.Module]:
    for m in model.modules():
        if isinstance(m, _KINDS):
            yield m


def covers(m: nn.Module) -> bool:
    """Whether book-keeping gives ``m``'s own parameters their per-sample gradients: a
    Linear, an ungrouped zero-padded Conv2d, an Embedding whose table the forward pass
    leaves alone (no ``max_norm``) and whose gradient is plain, a LayerNorm or GroupNorm,
    or a torch recurrent layer (``make_private`` swaps those for :mod:`.recurrent`'s, or
    for a bidirectional one Opacus' DPLSTM/DPGRU/DPRNN, both built of Linear layers)."""
    if type(m) in (nn.LSTM, nn.GRU, nn.RNN):  # what make_private swaps (exact types)
        return True
    if isinstance(m, nn.Conv2d):
        return m.groups == 1 and m.padding_mode == "zeros"
    if isinstance(m, nn.Embedding):
        return m.max_norm is None and not m.scale_grad_by_freq and not m.sparse
    return isinstance(m, _KINDS)


def supports(model: nn.Module) -> bool:
    """True when every trained parameter belongs to a layer book-keeping :func:`covers`
    (and no layer trains a weight but not its bias, or the other way round)."""
    return not uncovered(model)


def uncovered(model: nn.Module) -> list[str]:
    """The kinds of layer whose trained parameters book-keeping cannot give per-sample
    gradients (a layer training its weight but not its bias is named too)."""
    covered = {id(p) for m in model.modules() if covers(m) for p in m.parameters()}
    kinds = {type(m).__name__ for m in model.modules()
             if any(p.requires_grad and id(p) not in covered
                    for p in m.parameters(recurse=False))}
    kinds |= {f"{type(m).__name__} (a frozen weight or bias beside a trained one)"
              for m in _layers(model)
              if len({p.requires_grad for p in m.parameters(recurse=False)}) > 1}
    # a Parameter two layers share (tied weights): each layer's norm would be taken
    # apart, |G_a|^2 + |G_b|^2 instead of |G_a + G_b|^2, an under-estimate
    owners: dict[int, list[str]] = {}
    for m in _layers(model):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(type(m).__name__)
    kinds |= {f"a Parameter shared by {' and '.join(names)} (tied weights)"
              for names in owners.values() if len(names) > 1}
    return sorted(kinds)


# The largest input unfolded per batch (elements: batch x output positions x kernel size
# x input channels) for which the unfolded product beats the grouped convolution
# (measured, one thread, batch 32, 2026-12-03: the small CNN's layers, 0.4M and 0.2M
# elements, 0.57 / 0.28 ms against 0.81 / 0.56 ms grouped; the McMahan CNN's first, 0.6M,
# 2.04 against 2.21 ms; its second, 5M, 11.5 against 11.1 ms, at batch 64 44.7 against 22.6).
UNFOLD_MAX_ELEMENTS = 2_000_000

# The most elements (batch x out x in) a Linear layer used at several steps instantiates
# as per-sample gradients; above it, its norms come from the steps' Gram matrices.
INSTANTIATE_MAX_ELEMENTS = 1 << 25


def _conv_grads(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor
                ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Per-sample weight gradients of ``m`` from its inputs ``a`` and output gradients
    ``g``, as ``[B, out_channels, K]`` in the layer's own order, and the map from a sum of
    them (``[out_channels, K]``) to the weight's shape. By the cheaper exact way for the
    layer's shape: the input unfolded channels-last (a strided view, copied once: the
    channels are the contiguous runs) times the output gradients, one batched product;
    or, for a large unfolded input, the weight backward of one grouped convolution with
    an example in each group (what ``torch.func.vmap`` of the backward runs, without its
    copy of the weight for every example)."""
    shape = m.weight.shape
    if a.shape[0] == 0:  # an empty Poisson batch: no example, no gradient
        return a.new_zeros(0, shape[0], shape[1:].numel()), lambda s: s.reshape(shape)
    kh, kw = m.kernel_size
    positions = g.shape[2] * g.shape[3]
    if a.shape[0] * positions * kh * kw * a.shape[1] <= UNFOLD_MAX_ELEMENTS:
        unfolded = _unfold_channels_last(m, a, g.shape[2], g.shape[3])
        grads = torch.bmm(g.flatten(2), unfolded)  # [B, out, kh * kw * in]
        return grads, lambda s: _weight_from_channels_last(s, m)
    # every example a group of its own: its input and output channels side by side in
    # one image; the weight only gives the gradient's shape (its values are not read)
    batch = a.shape[0]
    padding = _padding(m)
    padding = list(padding) if isinstance(padding, tuple) else [padding, padding]
    grads = torch.ops.aten.convolution_backward(
        g.reshape(1, -1, *g.shape[2:]).contiguous(), a.reshape(1, -1, *a.shape[2:]).contiguous(),
        m.weight.new_empty(batch * shape[0], *shape[1:]), None, list(m.stride), padding,
        list(m.dilation), False, [0, 0], batch * m.groups, [False, True, False])[1]
    return grads.reshape(batch, shape[0], -1), lambda s: s.reshape(shape)


def _unfold_channels_last(m: nn.Conv2d, a: torch.Tensor, out_h: int, out_w: int
                          ) -> torch.Tensor:
    """``[B, out_h * out_w, kh * kw * in]``: each output position's receptive field,
    channels innermost (what ``F.unfold`` gives, transposed and in another order, at a
    fraction of its cost on small inputs)."""
    ph, pw = _pair(_padding(m))
    x = a.contiguous(memory_format=torch.channels_last)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph)).contiguous(memory_format=torch.channels_last)
    x = x.permute(0, 2, 3, 1)  # [B, H, W, C], contiguous
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    b, _, _, c = x.shape
    st = x.stride()
    view = x.as_strided((b, out_h, out_w, kh, kw, c),
                        (st[0], st[1] * sh, st[2] * sw, st[1] * dh, st[2] * dw, st[3]))
    return view.reshape(b, out_h * out_w, kh * kw * c)


def _weight_from_channels_last(s: torch.Tensor, m: nn.Conv2d) -> torch.Tensor:
    """A gradient with its columns in :func:`_unfold_channels_last`'s (kh, kw, in) order,
    as ``m.weight``'s [out, in, kh, kw] (a view)."""
    out, inp, kh, kw = m.weight.shape
    return s.view(out, kh, kw, inp).permute(0, 3, 1, 2)


def _conv_grad_sample(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients ``[B, *weight.shape]`` (a view of :func:`_conv_grads`)."""
    grads, to_weight = _conv_grads(m, a, g)
    return torch.stack([to_weight(x) for x in grads]) if len(grads) else \
        grads.reshape(0, *m.weight.shape)


def _sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Each row's squared L2 norm (one pass, no squared copy of ``x``)."""
    return torch.linalg.vector_norm(x, dim=1).square()


def _pair(p: tuple[int, ...] | int) -> tuple[int, int]:
    return (p, p) if isinstance(p, int) else (p[0], p[1])


def _padding(m: nn.Conv2d) -> tuple[int, ...] | int:
    if m.padding == "valid":
        return 0
    if m.padding == "same":  # symmetric only: odd effective kernels
        return tuple(d * (k - 1) // 2 for k, d in zip(m.kernel_size, m.dilation, strict=True))
    return m.padding


class BookKeeping(nn.Module):
    """Wraps a model: records each layer's input and output gradient in the forward and
    backward pass (at each use of the layer), and turns them into the clipped per-sample
    gradient sum."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not supports(model) or any(isinstance(m, nn.RNNBase) for m in model.modules()):
            raise ValueError("book-keeping supports models made of Linear, ungrouped "
                             "Conv2d, Embedding, LayerNorm and GroupNorm layers only (torch's "
                             "recurrent layers once swapped for Opacus': "
                             "privacy.dp.dpsgd.private_layers)")
        self._module = model  # the name Opacus' wrappers use (dpsgd.unwrap)
        self.layers = [m for m in _layers(model)
                       if any(p.requires_grad for p in m.parameters(recurse=False))]
        self.params = [p for m in self.layers for p in m.parameters(recurse=False)
                       if p.requires_grad]
        # per layer, one [input, output gradient] per use in the pass
        self.saved: dict[nn.Module, list[list[torch.Tensor]]] = {}
        self._batch = 0  # the examples in this pass
        self._handles = [m.register_forward_hook(self._record) for m in self.layers]
        # recurrent layers run their Linear layers' maths themselves and hand each one's
        # input and output here once per sequence (privacy.dp.recurrent)
        self._recurrent = [m for m in model.modules() if isinstance(m, SequenceRecurrent)]
        for m in self._recurrent:
            m.recorder = self._record_use
        for p in self.params:
            p.requires_grad_(False)

    def _record(self, module: nn.Module, inputs: tuple[torch.Tensor, ...],
                output: torch.Tensor) -> None:
        if not self.training or not torch.is_grad_enabled():  # no gradient from this use
            return
        if inputs[0].shape[:1] != (self._batch,):  # per-example rows would be mixed up
            raise RuntimeError(
                f"{type(module).__name__} received an input of shape "
                f"{tuple(inputs[0].shape)}, whose first dimension is not the batch of "
                f"{self._batch}: book-keeping needs every layer's input batch-first "
                "(as Opacus' hooks do); a sequence-first layer would have its rows "
                "credited to the wrong examples.")
        uses = self.saved.setdefault(module, [])
        if uses and isinstance(module, nn.Conv2d):
            raise RuntimeError("Conv2d ran twice in one forward pass (shared weights): "
                               "book-keeping does not support that")
        entry = [inputs[0].detach()]
        uses.append(entry)
        replaced = None
        if not output.requires_grad:  # nothing trained below: backward stops here
            output = replaced = output.detach().requires_grad_(True)
        output.register_hook(lambda g: entry.append(g.detach()))
        return replaced

    def _record_use(self, layer: nn.Linear, inputs: torch.Tensor, output: torch.Tensor
                    ) -> torch.Tensor:
        """:meth:`_record` for a use a recurrent layer reports (the output to go on with)."""
        replaced = self._record(layer, (inputs,), output)
        return output if replaced is None else replaced

    def forward(self, x: torch.Tensor) -> Any:
        self.saved = {}
        self._batch = x.shape[0]
        return self._module(x)

    def clipped_sums(self, max_grad_norm: float) -> list[torch.Tensor]:
        """Per parameter (in ``self.params`` order), the sum over the batch of each
        example's gradient clipped to ``max_grad_norm`` in L2 over all parameters.

        The recorded output gradients are those of the batch's mean loss, each example's
        own gradient divided by the batch size B; they are used as recorded, and B enters
        once, in the [B] norms and the clipping weights, instead of a pass over every
        layer's output gradients."""
        per_layer = [self._per_sample(m) for m in self.layers]
        batch = per_layer[0].batch if per_layer else 0
        norms_sq = torch.zeros(batch, device=per_layer[0].sq.device if per_layer else None)
        for layer in per_layer:
            norms_sq = norms_sq + layer.sq
        norms = norms_sq.sqrt() * batch  # each example's own gradient norm
        weights = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0) * batch
        sums: list[torch.Tensor] = []
        for layer in per_layer:
            sums += layer.clipped(weights)
        self.saved = {}
        return sums

    def remove(self) -> nn.Module:
        """Detach the hooks, give the parameters their gradients back and drop what
        Opacus' optimizer kept on them: the plain model, as it was built."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self._recurrent:
            m.recorder = None
        for p in self.params:
            p.requires_grad_(True)
            p.grad = None
            if hasattr(p, "summed_grad"):
                del p.summed_grad
        self.saved = {}
        return self._module

    def _uses(self, m: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (input, output gradient) of each use of ``m`` that a gradient reached."""
        entries = self.saved.get(m, [])
        if any(len(e) > 2 for e in entries):
            raise RuntimeError(f"{type(m).__name__} received two gradients for one use: "
                               "book-keeping needs one backward pass per forward pass")
        uses = [(e[0], e[1]) for e in entries if len(e) == 2]
        if not uses:
            raise RuntimeError(f"no gradient reached {type(m).__name__}: call backward() "
                               "on the loss of this forward pass before the optimizer step")
        return uses

    def _per_sample(self, m: nn.Module) -> _Layer:
        """The layer's per-sample squared gradient norms (of the batch's mean loss) and
        what it needs to form its clipped sum."""
        uses = self._uses(m)
        if isinstance(m, nn.Embedding):
            return _embedding(m, uses)
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
            return _normalization(m, uses)
        if isinstance(m, nn.Linear):
            if len(uses) == 1 and uses[0][0].dim() == 2:
                return _linear(m, *uses[0])
            return _linear_steps(m, uses)
        return _conv(m, *uses[0])


class _Layer:
    """One layer's part of a clipping step: per-sample squared norms ``sq`` ([B]) and
    ``clipped(weights)``, the clipping-weighted sums for its parameters, in order."""

    def __init__(self, batch: int, sq: torch.Tensor,
                 clipped: Callable[[torch.Tensor], list[torch.Tensor]]) -> None:
        self.batch, self.sq, self.clipped = batch, sq, clipped


def _bias(m: nn.Module, g: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    """The clipped bias sum from the per-sample bias gradients ``g`` ([B, out])."""
    return [weights @ g] if m.bias is not None else []


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, ..., d)`` as ``(B, T, d)``: each example's rows (one for a ``(B, d)`` input)."""
    return x.unsqueeze(1) if x.dim() == 2 else x.flatten(1, -2)


def _joined(rows: list[torch.Tensor]) -> torch.Tensor:
    """The uses' rows side by side, ``(B, T_1 + T_2 + ..., d)`` (one use: as it is)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows, 1)


def _linear(m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> _Layer:
    """One use on ``(B, in)``: the ghost norm ``|g_i| |a_i|``; the clipped sum one product."""
    g_sq = _sq_norms(g)
    sq = _sq_norms(a) * g_sq + (g_sq if m.bias is not None else 0)
    return _Layer(a.shape[0], sq,
                  lambda w: [torch.mm(g.t() * w, a), *_bias(m, g, w)])


def _linear_steps(m: nn.Linear, uses: list[tuple[torch.Tensor, torch.Tensor]]) -> _Layer:
    """Several uses (time steps) or a sequence input: each example's gradient is
    ``G_i^T A_i`` over its ``T`` rows, instantiated by one batched product (its clipped
    sum is then a weighted sum), or, when the ``B`` copies would be too large, normed by
    the Gram matrices of the rows and summed as one product."""
    a = _joined([_rows(x) for x, _ in uses])
    g = _joined([_rows(y) for _, y in uses])
    batch, out, inp = a.shape[0], g.shape[2], a.shape[2]
    g_bias = g.sum(1)
    bias_sq = _sq_norms(g_bias) if m.bias is not None else 0
    if batch * out * inp <= INSTANTIATE_MAX_ELEMENTS:
        grads = torch.bmm(g.transpose(1, 2), a).flatten(1)  # [B, out * in]
        return _Layer(batch, _sq_norms(grads) + bias_sq, lambda w: [
            (w @ grads).view(out, inp), *_bias(m, g_bias, w)])
    sq = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
    return _Layer(batch, sq + bias_sq, lambda w: [
        torch.mm((g * w[:, None, None]).reshape(-1, out).t(), a.reshape(-1, inp)),
        *_bias(m, g_bias, w)])


def _embedding(m: nn.Embedding, uses: list[tuple[torch.Tensor, torch.Tensor]]) -> _Layer:
    """Each example's gradient adds ``g_t`` to row ``x_t`` of the table: its squared norm
    is ``sum_{t,s} [x_t = x_s] <g_t, g_s>`` (rows of ``padding_idx`` get none), and the
    clipped sum adds every ``w_i g_t`` into its row."""
    ids = _joined([x.unsqueeze(1) if x.dim() == 1 else x.flatten(1) for x, _ in uses])
    g = _joined([_rows(y) for _, y in uses])
    if m.padding_idx is not None:
        g = g * (ids != m.padding_idx).unsqueeze(-1)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [B, T, T]
    sq = (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))

    def clipped(w: torch.Tensor) -> list[torch.Tensor]:
        rows = (g * w[:, None, None]).reshape(-1, g.shape[2])
        return [m.weight.new_zeros(m.weight.shape).index_add_(0, ids.flatten(), rows)]

    return _Layer(ids.shape[0], sq, clipped)


def _normalization(m: nn.LayerNorm | nn.GroupNorm,
                   uses: list[tuple[torch.Tensor, torch.Tensor]]) -> _Layer:
    """Per-sample gradients of a LayerNorm's or GroupNorm's affine map, summed over its
    uses and positions: ``g * x_hat`` for the weight, ``g`` for the bias (per channel)."""
    grads: list[torch.Tensor] = []
    for a, g in uses:
        if isinstance(m, nn.LayerNorm):
            x_hat = F.layer_norm(a, m.normalized_shape, None, None, m.eps)
            k = len(m.normalized_shape)  # [B, positions, channels], channels flattened

            def per_sample(x: torch.Tensor, k: int = k) -> torch.Tensor:
                return _rows(x.flatten(-k)).sum(1)
        else:
            x_hat = F.group_norm(a, m.num_groups, None, None, m.eps)

            def per_sample(x: torch.Tensor) -> torch.Tensor:  # [B, C, positions]
                return (x.flatten(2) if x.dim() > 2 else x.unsqueeze(2)).sum(2)
        sample = [per_sample(g * x_hat)] + ([per_sample(g)] if m.bias is not None else [])
        grads = sample if not grads else [s + t for s, t in zip(grads, sample, strict=True)]
    sq = sum(_sq_norms(x) for x in grads)
    shape = m.weight.shape
    return _Layer(grads[0].shape[0], sq,
                  lambda w: [(w @ x).view(shape) for x in grads])


def ghost_cheaper(positions: int, kernel: int, out_channels: int) -> bool:
    """Whether a convolution's per-example norms are cheaper from the Gram matrices of its
    unfolded inputs and output gradients (the ghost norm, Goodfellow 2015; Li et al. 2022)
    than from instantiated per-example gradients: per example, with T output positions,
    K = kernel x input channels and p output channels, the Gram products cost T^2 (K + p)
    multiply-adds and the clipped sum one T K p product over the whole batch (SGD's own
    weight gradient, one large GEMM); instantiating costs the T K p product example by
    example (small batched products or a grouped convolution, several times slower per
    multiply-add on a CPU) and writes every example's K p gradient. Bu et al. 2023's
    mixed ghost clipping chooses per layer; its space criterion (2 T^2 < K p) sends the
    small CNN's second layer and a ResNet-18's 16 x 16 stage the wrong way on a CPU, so
    the rule here is the measured one (``experiments.benchmarks.conv_clipping``, seven
    layer shapes): ghost when the Gram products cost less than half the per-example
    product, T^2 (K + p) < T K p / 2. A CIFAR ResNet-18's last two stages go ghost (3-15x
    faster there); the MNIST CNNs' layers do not."""
    return 2 * positions * (kernel + out_channels) < kernel * out_channels


def _conv(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> _Layer:
    """The ghost norm when that is cheaper for the layer's shape (:func:`ghost_cheaper`),
    else instantiated per-sample gradients."""
    kh, kw = m.kernel_size
    if a.shape[0] and ghost_cheaper(g.shape[2] * g.shape[3], kh * kw * a.shape[1],
                                    g.shape[1]):
        return _conv_ghost(m, a, g)
    return _conv_instantiated(m, a, g)


def _conv_instantiated(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> _Layer:
    """Per-sample weight gradients (:func:`_conv_grads`); the bias's are the output
    gradients summed over positions."""
    grads, to_weight = _conv_grads(m, a, g)
    sq = _sq_norms(grads.flatten(1))
    g = g.flatten(2).sum(2)  # (an empty batch cannot be reshaped with -1)
    if m.bias is not None:
        sq = sq + _sq_norms(g)

    def clipped(w: torch.Tensor) -> list[torch.Tensor]:
        summed = w @ grads.flatten(1)
        return [to_weight(summed.view(grads.shape[1:])).contiguous(), *_bias(m, g, w)]

    return _Layer(grads.shape[0], sq, clipped)


def _conv_ghost(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> _Layer:
    """Each example's squared weight-gradient norm ``|G_i|^2 = <U_i U_i^T, D_i D_i^T>``
    (``U_i`` its unfolded input, T x K, ``D_i`` its output gradients, T x p) without
    forming ``G_i = D_i^T U_i``; the clipped sum is one product over the batch's
    positions, ``(w D)^T U``."""
    batch, out, oh, ow = g.shape
    unfolded = _unfold_channels_last(m, a, oh, ow)  # [B, T, K], K in (kh, kw, in) order
    d = g.permute(0, 2, 3, 1).reshape(batch, oh * ow, out)  # [B, T, p]
    sq = (torch.bmm(unfolded, unfolded.transpose(1, 2))
          * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
    g_bias = d.sum(1)
    if m.bias is not None:
        sq = sq + _sq_norms(g_bias)

    def clipped(w: torch.Tensor) -> list[torch.Tensor]:
        summed = torch.mm((d * w[:, None, None]).reshape(-1, out).t(),
                          unfolded.reshape(-1, unfolded.shape[2]))
        return [_weight_from_channels_last(summed, m).contiguous(), *_bias(m, g_bias, w)]

    return _Layer(batch, sq, clipped)


def make_optimizer_class(base: type) -> type:
    """Opacus' DPOptimizer with its clipping step taken from a :class:`BookKeeping`."""

    class BookKeepingOptimizer(base):  # type: ignore[misc, valid-type]
        def __init__(self, optimizer: torch.optim.Optimizer, *, bookkeeping: BookKeeping,
                     draw_ahead: bool = True, **kwargs: Any) -> None:
            self.bookkeeping = bookkeeping
            self.draw_ahead = draw_ahead
            # the noise's two buffer sets (one in use, one drawn into ahead) and the draw
            # ahead: ((shapes, std) it was drawn for, its future)
            self._sets: list[list[torch.Tensor] | None] = [None, None]
            self._ahead: tuple[Any, Future] | None = None
            super().__init__(optimizer, **kwargs)

        @property
        def params(self) -> list[nn.Parameter]:  # frozen during the pass, trained still
            return self.bookkeeping.params

        @property
        def grad_samples(self) -> list[torch.Tensor]:
            return []

        @property
        def accumulated_iterations(self) -> int:  # one batch per step (Poisson sampling)
            return 1

        def clip_and_accumulate(self) -> None:
            sums = self.bookkeeping.clipped_sums(self.max_grad_norm)
            for p, s in zip(self.params, sums, strict=True):
                s = s.to(p.dtype)
                p.summed_grad = s if p.summed_grad is None else p.summed_grad + s

        def add_noise(self) -> None:
            """Opacus' ``add_noise`` (the same draws, to the bit) without its three fresh
            tensors a step: the noise is drawn in place into buffers kept per parameter
            (on the McMahan CNN's 1.66M weights the allocations cost as much as the draw).
            With a generator of its own and ``draw_ahead``, the next step's noise is drawn
            ahead on a worker thread while this step trains (:func:`_draw_ahead`)."""
            if self.secure_mode:  # Opacus' four-draw sampling, unchanged
                super().add_noise()
                return
            from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

            std = self.noise_multiplier * self.max_grad_norm
            summed = [p.summed_grad for p in self.params]
            for s in summed:
                _check_processed_flag(s)
            noise = self._noise_for(summed, std)
            for p, s, buf in zip(self.params, summed, noise, strict=True):
                p.grad = buf.add_(s).view_as(p)
                _mark_as_processed(s)

        def _noise_for(self, summed: list[torch.Tensor], std: float) -> list[torch.Tensor]:
            """This step's noise, one buffer per parameter: ``normal_(0, std)`` into each in
            the parameters' order (what Opacus' ``_generate_noise`` draws)."""
            shapes = [(s.shape, s.dtype, s.device) for s in summed]
            ahead = self._ahead
            if ahead is not None and ahead[0] == (shapes, std):
                noise = ahead[1].result()  # drawn while this step trained
            else:
                if ahead is not None:  # never: the shapes and std are fixed for a training
                    raise RuntimeError("DP-SGD's noise was drawn ahead for another shape or "
                                       "noise level; the draws would no longer be Opacus'")
                noise = _draw(self._buffers(summed, 0), std, self.generator)
            if self.draw_ahead and self.generator is not None and std > 0:  # its own stream
                spare = self._buffers(summed, 1 if noise is self._sets[0] else 0)
                self._ahead = ((shapes, std), _draw_ahead(spare, std, self.generator))
            return noise

        def _buffers(self, summed: list[torch.Tensor], which: int) -> list[torch.Tensor]:
            """Buffer set ``which`` (two: one in use, one being drawn into ahead)."""
            sets = self._sets
            bufs = sets[which]
            if bufs is None or any(b.shape != s.shape or b.dtype != s.dtype
                                   for b, s in zip(bufs, summed, strict=True)):
                bufs = sets[which] = [torch.empty_like(s) for s in summed]
            return bufs

        def pre_step(self, closure: Any = None) -> bool:
            self.clip_and_accumulate()
            if self._check_skip_next_step():
                self._is_last_step_skipped = True
                return False
            self.add_noise()
            self.scale_grad()
            if self.step_hook:
                self.step_hook(self)
            self._is_last_step_skipped = False
            return True

        def step(self, closure: Any = None) -> float | None:
            """Opacus' step; for a plain ``torch.optim.SGD`` its update is applied by the
            functional ``sgd`` with the arguments ``SGD.step`` passes it (the same bits,
            tested), without ``Optimizer.step``'s profiling and hook machinery, which
            costs about as much as the update on a small model."""
            group = _plain_sgd_group(self.original_optimizer)
            if closure is not None or group is None:
                return super().step(closure)
            if self.pre_step():
                _sgd_update(self.original_optimizer, group)
            return None

        def zero_grad(self, set_to_none: bool = False) -> None:
            """Opacus' ``zero_grad`` (its per-sample state dropped, then the wrapped
            optimizer's); for a plain SGD's ``set_to_none`` the gradients are dropped
            here, as ``Optimizer.zero_grad`` would, without its profiling scope."""
            if not set_to_none or _plain_sgd_group(self.original_optimizer) is None:
                super().zero_grad(set_to_none)
                return
            for p in self.params:
                p.grad_sample = None
                if not self._is_last_step_skipped:
                    p.summed_grad = None
            for group in self.original_optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    return BookKeepingOptimizer


def _plain_sgd_group(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The one parameter group of a plain ``torch.optim.SGD`` (not fused, not
    differentiable, no gradient scaler, no step hooks of its own or global), else None."""
    from torch.optim import optimizer as torch_optimizer

    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    if group.get("fused") or group.get("differentiable") or \
            getattr(optimizer, "grad_scale", None) is not None or \
            getattr(optimizer, "found_inf", None) is not None or \
            optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or \
            torch_optimizer._global_optimizer_pre_hooks or \
            torch_optimizer._global_optimizer_post_hooks:
        return None
    return group


@torch.no_grad()
def _sgd_update(optimizer: torch.optim.SGD, group: dict[str, Any]) -> None:
    """``SGD.step``'s update of ``group``: its functional ``sgd`` on the parameters that
    have a gradient, the momentum buffers kept in the optimizer's state as it keeps them."""
    from torch.optim.sgd import sgd

    params = [p for p in group["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    momentum = group["momentum"]
    buffers = [optimizer.state[p].get("momentum_buffer") for p in params] \
        if momentum != 0 else []
    sgd(params, grads, buffers, weight_decay=group["weight_decay"], momentum=momentum,
        lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
        maximize=group["maximize"], has_sparse_grad=any(g.is_sparse for g in grads),
        foreach=group["foreach"], fused=group["fused"], grad_scale=None, found_inf=None)
    if momentum != 0:
        for p, buffer in zip(params, buffers, strict=True):
            optimizer.state[p]["momentum_buffer"] = buffer


def _draw(buffers: list[torch.Tensor], std: float, generator: torch.Generator | None
          ) -> list[torch.Tensor]:
    """``torch.normal(0, std, size)`` of Opacus' ``_generate_noise`` into each buffer, in
    order (zeros when ``std`` is 0, as Opacus returns then)."""
    for buf in buffers:
        if std == 0:
            buf.zero_()
        else:
            buf.normal_(0, std, generator=generator)
    return buffers


def _draw_ahead(buffers: list[torch.Tensor], std: float, generator: torch.Generator
                ) -> Future:
    """Draw the next step's noise on a worker thread (torch releases the GIL: it runs on
    another core while this step's forward and backward pass run here). Only for a
    generator of the training's own, which nothing else draws from, so the draws are the
    ones the step would make itself, in the same order; a training's last step leaves
    one set drawn and unused."""
    return background.submit("noise", _draw, buffers, std, generator)
