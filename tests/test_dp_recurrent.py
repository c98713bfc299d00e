"""The recurrent layers book-keeping DP-SGD trains (privacy.dp.recurrent): torch's LSTM,
GRU and RNN to float rounding, their weights moved across and back bit for bit, and each
example's clipped gradient Opacus' (hooks on its DPLSTM/DPGRU/DPRNN)."""

import pytest
import torch
from torch import nn

from privacy.dp.dpsgd import make_private, plain_layers, private_layers
from privacy.dp.recurrent import SequenceRecurrent, sequence_layer, supported
from tasks.training import make_loader, sgd

LAYERS = [(nn.GRU, {}), (nn.LSTM, {}), (nn.RNN, {"nonlinearity": "tanh"}),
          (nn.RNN, {"nonlinearity": "relu"})]


@pytest.mark.parametrize("kind, extra", LAYERS)
@pytest.mark.parametrize("layers, batch_first, bias", [(1, True, True), (2, False, True),
                                                       (2, True, False)])
def test_a_rebuilt_layer_computes_torchs_outputs_states_and_gradients(kind, extra, layers,
                                                                     batch_first, bias):
    torch.manual_seed(0)
    fused = kind(6, 9, layers, batch_first=batch_first, bias=bias, **extra)
    rebuilt = sequence_layer(fused)
    x = torch.randn(4, 7, 6)
    h0 = torch.randn(layers, 4 if batch_first else 7, 9)
    state = (h0, torch.randn_like(h0)) if kind is nn.LSTM else h0
    for given in (None, state):
        out_f, h_f = fused(x) if given is None else fused(x, given)
        out_r, h_r = rebuilt(x) if given is None else rebuilt(x, given)
        torch.testing.assert_close(out_r, out_f, rtol=1e-5, atol=1e-6)
        for a, b in zip(h_r if kind is nn.LSTM else [h_r], h_f if kind is nn.LSTM else [h_f],
                        strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # SGD's gradients, under torch's parameter names
    (out_f.square().sum() + sum(h.sum() for h in (h_f if kind is nn.LSTM else [h_f]))).backward()
    (out_r.square().sum() + sum(h.sum() for h in (h_r if kind is nn.LSTM else [h_r]))).backward()
    for k in range(layers):
        for name, p in rebuilt._names(k):
            torch.testing.assert_close(p.grad, getattr(fused, name).grad, rtol=1e-4, atol=1e-5)
    back = rebuilt.plain()
    assert type(back) is kind and list(back.state_dict()) == list(fused.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                 fused.state_dict().values(), strict=True))
    if kind is nn.RNN:
        assert back.nonlinearity == fused.nonlinearity


class _Stack(nn.Module):
    """An embedding, a recurrent stack (sequence-first when asked) and a head."""

    def __init__(self, kind: type, layers: int, batch_first: bool, **extra) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(20, 5)
        self.rnn = kind(5, 8, layers, batch_first=batch_first, **extra)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        e = self.embed(x)
        out, _ = self.rnn(e if self.batch_first else e.transpose(0, 1))
        return self.head(out[:, -1] if self.batch_first else out[-1])


def _private(model, mode, clip, noise=0.0, noise_seed=None):
    torch.manual_seed(3)
    x, y = torch.randint(0, 20, (24, 11)), torch.randint(0, 4, (24,))
    return make_private(model, sgd(model, 0.1), make_loader(x, y, 6, 0),
                        noise_multiplier=noise, max_grad_norm=clip, grad_sample_mode=mode,
                        seed=0, noise_seed=noise_seed), x, y


@pytest.mark.parametrize("kind, extra", LAYERS)
@pytest.mark.parametrize("layers, batch_first", [(1, True), (2, False)])
@pytest.mark.parametrize("clip", [0.05, 1e4])  # every example clipped / none
def test_bookkeeping_clips_each_examples_gradient_as_opacus_hooks_do(kind, extra, layers,
                                                                    batch_first, clip):
    sums = {}
    for mode in ("hooks", "bookkeeping"):
        torch.manual_seed(1)
        private, x, y = _private(_Stack(kind, layers, batch_first, **extra), mode, clip)
        swapped = [m for m in private.model.modules()
                   if isinstance(m, SequenceRecurrent) or type(m).__name__.startswith("DP")]
        # book-keeping trains the rebuilt layers; Opacus' own modes its DP layers
        assert isinstance(swapped[0], SequenceRecurrent) == (mode == "bookkeeping")
        private.optimizer.zero_grad(set_to_none=True)
        private.criterion(private.model(x[:6]), y[:6]).backward()
        private.optimizer.clip_and_accumulate()
        sums[mode] = [p.summed_grad.detach().clone() for p in private.optimizer.params]
    assert [s.shape for s in sums["hooks"]] == [s.shape for s in sums["bookkeeping"]]
    for a, b in zip(sums["hooks"], sums["bookkeeping"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    norm = torch.sqrt(sum(s.pow(2).sum() for s in sums["bookkeeping"]))
    assert float(norm) <= 6 * clip * (1 + 1e-5)


def test_a_two_layer_lstm_trains_as_under_opacus_hooks_and_comes_back_as_torchs():
    # noise included: the same parameters in the same order as Opacus' DPLSTM, so the same
    # draws land on the same weights
    states = {}
    for mode in ("hooks", "bookkeeping"):
        torch.manual_seed(1)
        private, *_ = _private(_Stack(nn.LSTM, 2, True), mode, 0.5, noise=1.0, noise_seed=7)
        for xb, yb in private.loader:
            private.optimizer.zero_grad(set_to_none=True)
            private.criterion(private.model(xb), yb).backward()
            private.optimizer.step()
        model = private.module()
        assert type(model.rnn) is nn.LSTM
        states[mode] = model.state_dict()
    assert list(states["hooks"]) == list(states["bookkeeping"])
    for k, v in states["hooks"].items():
        torch.testing.assert_close(states["bookkeeping"][k], v, rtol=1e-4, atol=1e-5)


def test_layers_the_rebuild_does_not_cover_keep_opacus_cells():
    from opacus.layers import DPGRU

    model = _Stack(nn.GRU, 1, True)
    model.rnn = nn.GRU(5, 4, bidirectional=True, batch_first=True)
    assert not supported(model.rnn)
    assert private_layers(model, "bookkeeping") and isinstance(model.rnn, DPGRU)
    assert isinstance(plain_layers(model).rnn, nn.GRU)
    plain = _Stack(nn.RNN, 1, True, nonlinearity="relu")
    private_layers(plain, "hooks")  # Opacus' DPRNN keeps the nonlinearity across and back
    assert plain_layers(plain).rnn.nonlinearity == "relu"


def test_a_packed_sequence_is_refused_with_the_way_out():
    from torch.nn.utils.rnn import pack_padded_sequence

    layer = sequence_layer(nn.GRU(3, 4, batch_first=True))
    packed = pack_padded_sequence(torch.randn(2, 5, 3), [5, 3], batch_first=True)
    with pytest.raises(ValueError, match="PackedSequence.*hooks"):
        layer(packed)


def test_the_lstm_sequence_node_and_the_per_step_graph_torch_func_sees_agree():
    # outside torch.func the recurrence is one node with a hand-written backward; inside
    # (vmap/grad) it is the per-step graph: the same outputs and the same gradients
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    layer = sequence_layer(nn.LSTM(5, 6, 2, batch_first=True))
    x, target = torch.randn(3, 8, 5), torch.randn(3, 8, 6)

    def loss(params, xb):
        out, (h, c) = functional_call(layer, params, (xb,))
        return ((out - target) ** 2).sum() + h.sum() + c.square().sum()

    params = {k: v.detach() for k, v in layer.named_parameters()}
    inside = grad(loss)(params, x)
    out, (h, c) = layer(x)
    ((out - target) ** 2).sum().add(h.sum()).add(c.square().sum()).backward()
    assert type(out.grad_fn).__name__ == "_LSTMSequenceBackward"
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, inside[name], rtol=1e-5, atol=1e-6)
