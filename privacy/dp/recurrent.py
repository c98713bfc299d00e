"""Torch's LSTM, GRU and RNN rebuilt from ``nn.Linear`` layers for book-keeping DP-SGD.

Torch's fused recurrent kernels give no per-example gradients, so DP-SGD trains a
recurrent model through layers whose weights are ordinary ``Linear`` layers (Opacus'
DPLSTM/DPGRU/DPRNN under its own modes). Opacus' cells run both of a layer's
projections, input and hidden, at every time step, and its hooks fire at each. Here, as
in ATen's own CPU kernels, a layer's input projection runs once over the whole sequence,
``(B, T, in) -> (B, T, gates * H)``, and only the hidden projection step by step. Under
book-keeping (:mod:`privacy.dp.bookkeeping`, which sets :attr:`SequenceRecurrent.recorder`)
each projection is reported once per sequence, its inputs and output gradients as
``(B, T, .)`` tensors: the hidden projection's inputs are the states ``h_0 .. h_{T-1}``;
its output gradients are the gates' (the LSTM and RNN add the two projections) or, for
the GRU, whose reset gate scales part of it, those of a zero-valued probe added to it.
So no hook runs per step, and each example's gradient is one batched product.

The LSTM's recurrence is one autograd node (:class:`_LSTMSequence`): the forward keeps
each step's activated gates and cell state, and the backward walks the steps back by
hand, with everything that does not depend on the step before (the gates' derivatives,
``tanh(c)``) computed for the whole sequence at once; each step is then one product with
the hidden weights and five elementwise operations, where autograd ran some twenty nodes
(the ``(B, T, 4H)`` gate gradient it returns is what book-keeping reads for both
projections). Inside ``torch.func`` transforms the recurrence is the per-step graph.

The same equations, gate order and elementwise operations as ATen's cells (GRU: r, z, n
with ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h' = (h - n) * z + n``; LSTM:
i, f, g, o): the outputs equal the fused layer's to float rounding (tested), and the
parameters are the fused layer's own, moved across and back (:func:`sequence_layer`,
:meth:`SequenceRecurrent.plain`), in Opacus' order (so the noise lands alike).
Unidirectional layers without projections (``proj_size = 0``), batched input; a
bidirectional or projected layer keeps Opacus' cells (:func:`supported`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

# torch's recurrent layer type -> (the kind its equations are, gates per hidden unit)
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def supported(layer: nn.Module) -> bool:
    """Whether ``layer`` is one of torch's LSTM, GRU or RNN that this module rebuilds."""
    return (type(layer) in (nn.LSTM, nn.GRU, nn.RNN) and not layer.bidirectional
            and getattr(layer, "proj_size", 0) == 0)


class SequenceRecurrent(nn.Module):
    """A stack of recurrent layers, each an input ``Linear`` (run on the whole sequence)
    and a hidden ``Linear`` (run at every step); built from a torch layer by
    :func:`sequence_layer`."""

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int,
                 bias: bool, batch_first: bool, dropout: float) -> None:
        super().__init__()
        gates = _GATES[mode]
        self.mode, self.hidden_size, self.num_layers = mode, hidden_size, num_layers
        self.input_size, self.bias, self.batch_first, self.dropout = (
            input_size, bias, batch_first, dropout)
        sizes = [input_size] + [hidden_size] * (num_layers - 1)
        # layer by layer, each its input then its hidden projection: Opacus' DPLSTM/DPGRU
        # order, so that the noise is drawn for the same parameters in the same order
        self.layers = nn.ModuleList(_Cell(n, hidden_size, gates, bias) for n in sizes)

    def _names(self, k: int) -> list[tuple[str, nn.Parameter]]:
        """Layer ``k``'s parameters under torch's names (its order: ih and hh weights, then
        their biases)."""
        ih, hh = self.layers[k].ih, self.layers[k].hh
        out = [(f"weight_ih_l{k}", ih.weight), (f"weight_hh_l{k}", hh.weight)]
        if self.bias:
            out += [(f"bias_ih_l{k}", ih.bias), (f"bias_hh_l{k}", hh.bias)]
        return out

    def plain(self) -> nn.RNNBase:
        """Torch's own layer with these weights (the same Parameter values, copied)."""
        kind = {"LSTM": nn.LSTM, "GRU": nn.GRU}.get(self.mode)
        extra: dict[str, Any] = {}
        if kind is None:
            kind, extra = nn.RNN, {"nonlinearity": self.mode[4:].lower()}
        layer = kind(self.input_size, self.hidden_size, self.num_layers, bias=self.bias,
                     batch_first=self.batch_first, dropout=self.dropout, **extra)
        device = self.layers[0].ih.weight.device
        layer.to(device)
        with torch.no_grad():
            for k in range(self.num_layers):
                for name, p in self._names(k):
                    getattr(layer, name).copy_(p)
        layer.train(self.training)
        return layer

    def forward(self, x: Any, hx: Any = None) -> tuple[torch.Tensor, Any]:
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(
                "the book-keeping recurrent layers take a batched 3-d tensor (batch, steps, "
                "features) with batch_first, or (steps, batch, features); got "
                f"{type(x).__name__}{'' if not isinstance(x, torch.Tensor) else tuple(x.shape)}"
                ". Pad the sequences to one length (no PackedSequence), or train with "
                "grad-sample-mode = 'hooks' (Opacus' recurrent layers).")
        seq = x if self.batch_first else x.transpose(0, 1)
        batch, lstm = seq.shape[0], self.mode == "LSTM"
        if hx is None:
            zeros = seq.new_zeros(self.num_layers, batch, self.hidden_size)
            hx = (zeros, zeros) if lstm else zeros
        record = self.recorder or _as_module
        h_n, c_n = [], []
        for k, cell in enumerate(self.layers):
            h0 = hx[0][k] if lstm else hx[k]
            ih, hh = cell.ih, cell.hh
            gx = record(ih, seq, F.linear(seq, ih.weight, ih.bias))  # once, on the sequence
            if self.mode == "GRU":
                # the hidden projection's output gradient at every step, through one
                # zero-valued leaf (r scales its n part, so it is not the input's)
                probe = (gx.new_zeros(gx.shape, requires_grad=True) if self.recorder
                         else None)
                seq, h = _gru(gx.unbind(1), None if probe is None else probe.unbind(1),
                              hh, h0)
            elif lstm:
                probe = gx  # the gates are input + hidden projection: the same gradient
                seq, (h, c) = _lstm(gx, hh, h0, hx[1][k])
                c_n.append(c)
            else:
                probe = gx
                seq, h = _rnn(gx.unbind(1), hh, h0, torch.tanh if self.mode == "RNN_TANH"
                              else torch.relu)
            if self.recorder is not None:  # each step's input: h0, then the outputs
                record(hh, torch.cat([h0.unsqueeze(1), seq[:, :-1]], 1), probe)
            h_n.append(h)
            if self.dropout and self.training and k < self.num_layers - 1:
                seq = F.dropout(seq, self.dropout, True)
        out = seq if self.batch_first else seq.transpose(0, 1)
        h_n_t = torch.stack(h_n)
        return out, ((h_n_t, torch.stack(c_n)) if lstm else h_n_t)

    # Set by book-keeping while it wraps the model: given (layer, its input, its output),
    # it keeps both for the layer's per-example gradients and returns the output to use.
    recorder: Callable[[nn.Linear, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _as_module(layer: nn.Linear, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    return output


class _Cell(nn.Module):
    """One layer's projections: ``ih`` on the sequence, ``hh`` at each step."""

    def __init__(self, inputs: int, hidden: int, gates: int, bias: bool) -> None:
        super().__init__()
        self.ih = nn.Linear(inputs, gates * hidden, bias)
        self.hh = nn.Linear(hidden, gates * hidden, bias)


def _gru(steps: tuple[torch.Tensor, ...], probes: tuple[torch.Tensor, ...] | None,
         hh: nn.Linear, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's GRU cell at each step: ``h' = (h - n) * z + n`` (with ``probes``, one added
    to each step's hidden projection: zeros whose gradient is its output gradient)."""
    outs = []
    w, b = hh.weight, hh.bias
    for t, gx in enumerate(steps):
        xr, xz, xn = gx.chunk(3, 1)
        gh = F.linear(h, w, b)
        hr, hz, hn = (gh if probes is None else gh + probes[t]).chunk(3, 1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + hn * r)
        h = (h - n) * z + n
        outs.append(h)
    return torch.stack(outs, 1), h


def _lstm(gx: torch.Tensor, hh: nn.Linear, h: torch.Tensor, c: torch.Tensor
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """ATen's LSTM cell at each step: ``c' = f * c + i * g``, ``h' = o * tanh(c')``; one
    autograd node for the sequence (:class:`_LSTMSequence`, the same floats forward)
    outside ``torch.func`` transforms."""
    if not torch._C._are_functorch_transforms_active():
        out, h, c = _LSTMSequence.apply(gx, h, c, hh.weight, hh.bias)
        return out, (h, c)
    outs = []
    w, b = hh.weight, hh.bias
    for step in gx.unbind(1):
        i, f, g, o = (F.linear(h, w, b) + step).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs, 1), (h, c)


class _LSTMSequence(torch.autograd.Function):
    """An LSTM layer's recurrence over a sequence given its input projections ``gx``
    ``(B, T, 4H)``: forward, ATen's cell step by step (the same operations as
    :func:`_lstm`'s loop); backward, backpropagation through time by hand (Werbos 1990):
    per step ``dh += dout_t``, ``dc += dh * o (1 - tanh^2 c)``, the gate gradient
    ``dz_t`` from ``dc`` and ``dh`` by factors computed for all steps at once, then
    ``dc *= f`` and ``dh = dz_t W_hh``. Returns ``dz`` as ``gx``'s gradient (the gates'
    pre-activation gradient, which book-keeping reads) and, when they are trained,
    ``W_hh``'s and ``b_hh``'s as one product over the sequence."""

    @staticmethod
    def forward(ctx: Any, gx: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor,
                w: torch.Tensor, b: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, steps, width = gx.shape
        hidden = width // 4
        gates = gx.new_empty(steps, batch, width)  # activated i, f, g, o; time-major
        cells = gx.new_empty(steps + 1, batch, hidden)
        out = gx.new_empty(batch, steps, hidden)
        cells[0] = c0
        h = h0
        for t in range(steps):
            z = F.linear(h, w, b).add_(gx[:, t])
            act = gates[t]
            torch.sigmoid(z, out=act)
            torch.tanh(z[:, 2 * hidden:3 * hidden], out=act[:, 2 * hidden:3 * hidden])
            i, f, g, o = act.chunk(4, 1)
            torch.add(f * cells[t], i * g, out=cells[t + 1])
            h = torch.mul(o, torch.tanh(cells[t + 1]), out=out[:, t])
        ctx.save_for_backward(gates, cells, out, h0, w)
        ctx.has_bias = b is not None
        return out, out[:, -1].clone(), cells[-1].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor | None, d_hn: torch.Tensor | None,
                 d_cn: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        gates, cells, out, h0, w = ctx.saved_tensors
        steps, batch, width = gates.shape
        hidden = width // 4
        i, f, g, o = gates.split(hidden, 2)
        tanh_c = torch.tanh(cells[1:])
        to_cell = o * (1 - tanh_c * tanh_c)  # dc += dh * to_cell
        from_cell = gates.new_empty(steps, batch, 3, hidden)  # dz_{i,f,g} = dc * from_cell
        torch.mul(g, i * (1 - i), out=from_cell[:, :, 0])
        torch.mul(cells[:-1], f * (1 - f), out=from_cell[:, :, 1])
        torch.mul(i, 1 - g * g, out=from_cell[:, :, 2])
        from_h = tanh_c * o * (1 - o)  # dz_o = dh * from_h
        forget = f.contiguous()
        d_out_t = (d_out if d_out is not None else out.new_zeros(out.shape)).transpose(0, 1)
        dz = gates.new_empty(steps, batch, width)
        dh = d_hn.clone() if d_hn is not None else h0.new_zeros(batch, hidden)
        dc = d_cn.clone() if d_cn is not None else h0.new_zeros(batch, hidden)
        for t in range(steps - 1, -1, -1):
            dh.add_(d_out_t[t])
            dc.addcmul_(dh, to_cell[t])
            torch.mul(dc.unsqueeze(1), from_cell[t], out=dz[t, :, :3 * hidden].view(
                batch, 3, hidden))
            torch.mul(dh, from_h[t], out=dz[t, :, 3 * hidden:])
            dc.mul_(forget[t])
            dh = torch.mm(dz[t], w)
        d_gx = dz.transpose(0, 1)
        d_w = d_b = None
        if ctx.needs_input_grad[3]:
            previous = torch.cat([h0.unsqueeze(1), out[:, :-1]], 1)
            d_w = torch.mm(d_gx.reshape(-1, width).t(), previous.reshape(-1, hidden))
        if ctx.has_bias and ctx.needs_input_grad[4]:
            d_b = dz.sum((0, 1))
        return (d_gx, dh if ctx.needs_input_grad[1] else None,
                dc if ctx.needs_input_grad[2] else None, d_w, d_b)


def _rnn(steps: tuple[torch.Tensor, ...], hh: nn.Linear, h: torch.Tensor,
         act: Any) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    w, b = hh.weight, hh.bias
    for gx in steps:
        h = act(F.linear(h, w, b) + gx)
        outs.append(h)
    return torch.stack(outs, 1), h


def sequence_layer(layer: nn.RNNBase) -> SequenceRecurrent:
    """``layer`` (torch's LSTM, GRU or RNN, :func:`supported`) rebuilt with its weights."""
    if not supported(layer):
        raise ValueError(f"{type(layer).__name__} (bidirectional or projected) is not "
                         "rebuilt here: Opacus' recurrent layers train it")
    new = SequenceRecurrent(layer.mode, layer.input_size, layer.hidden_size,
                            layer.num_layers, layer.bias, layer.batch_first,
                            float(layer.dropout))
    new.to(next(layer.parameters()).device)
    with torch.no_grad():
        for k in range(layer.num_layers):
            for name, p in new._names(k):
                p.copy_(getattr(layer, name))
    new.train(layer.training)
    return new
