"""Book-keeping DP-SGD (Bu et al. 2023) against Opacus' hooks, one batch at a time, and
its noise measured from the mechanism actually run (Monte Carlo)."""

import pytest
import torch

from privacy.dp.accounting import epsilon
from privacy.dp.dpsgd import make_private
from tasks.models import build_model
from tasks.training import convolutions_channels_last, make_loader, sgd


def _shape(name):
    """(input shape, classes): 80-character windows of an 80-symbol alphabet for the
    character models, 32x32 colour images for the ResNet, 28x28 grey ones otherwise."""
    if name.startswith("char-"):
        return (80,), 80
    return ((3, 32, 32) if name == "resnet18" else (1, 28, 28)), 10


def _data(name, n):
    shape, classes = _shape(name)
    if name.startswith("char-"):
        return torch.randint(0, 80, (n, 80)), torch.randint(0, 80, (n,))
    return torch.randn(n, *shape), torch.randint(0, classes, (n,))


def _private(name, mode, noise, clip, batch, momentum=0.0, noise_seed=None,
             channels_last=False, draw_ahead=True):
    torch.manual_seed(0)
    model = build_model(name, *_shape(name))
    if channels_last:  # as a client trains on the CPU
        convolutions_channels_last(model, torch.device("cpu"))
    x, y = _data(name, 4 * batch)
    return make_private(model, sgd(model, 0.1, momentum), make_loader(x, y, batch, 0),
                        noise_multiplier=noise, max_grad_norm=clip, grad_sample_mode=mode,
                        seed=0, noise_seed=noise_seed, draw_ahead=draw_ahead)


def _clipped_sums(private, x, y):
    """The sum over the batch of each example's clipped gradient, per parameter."""
    private.optimizer.zero_grad(set_to_none=True)
    private.criterion(private.model(x), y).backward()
    private.optimizer.clip_and_accumulate()
    return [p.summed_grad.detach().clone() for p in private.optimizer.params]


@pytest.mark.parametrize("shape", [
    (16, 32, 4, 2, 0, 13, 1),  # the small CNN's second layer: unfolded channels-last
    (1, 16, 8, 2, 3, 28, 1),  # its first, padded
    (3, 8, 3, 1, "same", 9, 2),  # string padding, dilated
    (4, 6, (3, 2), (2, 1), (1, 0), 11, 1),  # rectangular kernel, stride and padding
    (32, 64, 5, 1, 2, 14, 1)])  # the McMahan CNN's second: a grouped convolution
@pytest.mark.parametrize("way", ["unfolded", "grouped"])
def test_each_way_to_per_sample_conv_gradients_is_autograd_per_example(shape, way,
                                                                       monkeypatch):
    from privacy.dp import bookkeeping
    from privacy.dp.bookkeeping import _conv_grad_sample

    default = bookkeeping.UNFOLD_MAX_ELEMENTS
    monkeypatch.setattr(bookkeeping, "UNFOLD_MAX_ELEMENTS", 10**12 if way == "unfolded" else 0)
    cin, cout, k, stride, pad, size, dilation = shape
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=pad, dilation=dilation)
    a = torch.randn(5, cin, size, size)
    if cin > 1:  # as the layer after a channels-last max-pool receives it
        a = a.contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(conv(a))
    grads = _conv_grad_sample(conv, a, g)
    assert grads.shape == (5, *conv.weight.shape)
    for i in range(5):  # each example's own weight gradient, by autograd
        conv.zero_grad()
        (conv(a[i:i + 1]) * g[i:i + 1]).sum().backward()
        torch.testing.assert_close(grads[i], conv.weight.grad, rtol=1e-4, atol=1e-4)
    unfolded = 32 * g.shape[2] * g.shape[3] * conv.weight[0].numel()  # at the default batch
    assert (unfolded <= default) == (cin != 32)  # which way the default picks


@pytest.mark.parametrize("shape", [
    (16, 32, 4, 2, 0, 13, 1), (1, 16, 8, 2, 3, 28, 1), (3, 8, 3, 1, "same", 9, 2),
    (4, 6, (3, 2), (2, 1), (1, 0), 11, 1), (64, 32, 3, 1, 1, 4, 1)])
def test_conv_ghost_norms_and_clipped_sum_are_each_examples_own(shape):
    # the ghost norm (Gram matrices of unfolded inputs and output gradients) is each
    # example's own weight-and-bias gradient norm, by autograd on that example alone, and
    # its clipped sum is the weighted sum of those gradients
    from privacy.dp.bookkeeping import _conv_ghost

    cin, cout, k, stride, pad, size, dilation = shape
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=pad, dilation=dilation)
    a = torch.randn(5, cin, size, size)
    if cin > 1:
        a = a.contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(conv(a))
    own = []
    for i in range(5):
        conv.zero_grad()
        (conv(a[i:i + 1]) * g[i:i + 1]).sum().backward()
        own.append((conv.weight.grad.clone(), conv.bias.grad.clone()))
    layer = _conv_ghost(conv, a, g)
    expected = torch.stack([w.pow(2).sum() + b.pow(2).sum() for w, b in own])
    torch.testing.assert_close(layer.sq, expected, rtol=1e-4, atol=1e-5)
    weights = torch.rand(5)
    weight_sum, bias_sum = layer.clipped(weights)
    pairs = list(zip(weights, own, strict=True))
    torch.testing.assert_close(weight_sum, sum(c * w for c, (w, _) in pairs),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bias_sum, sum(c * b for c, (_, b) in pairs),
                               rtol=1e-4, atol=1e-4)


def test_ghost_norms_are_chosen_for_a_resnets_last_stages_not_for_the_mnist_cnns():
    # (output positions, kernel x input channels, output channels) of each layer
    from privacy.dp.bookkeeping import ghost_cheaper

    assert not ghost_cheaper(196, 64, 16)  # the small CNN's first convolution
    assert not ghost_cheaper(25, 256, 32)  # its second
    assert not ghost_cheaper(196, 800, 64)  # the McMahan CNN's second
    assert not ghost_cheaper(256, 1152, 128)  # a CIFAR ResNet-18's second stage (16x16)
    assert not ghost_cheaper(64, 128, 256)  # its third stage's 1x1 shortcut
    assert ghost_cheaper(64, 2304, 256)  # its third stage (8x8)
    assert ghost_cheaper(16, 4608, 512)  # its last stage (4x4)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", ["small-cnn", "cnn"])
def test_clipped_sum_equals_opacus_hooks_on_the_same_batch(name, channels_last):
    # each convolution's per-sample weight gradients (unfolded or vmap'd) and the ghost
    # norms of the dense layers give the same clipped sum as Opacus' materialized
    # per-sample gradients, in either layout of the convolutions; a clip of 0.05 clips
    # every example, so the factors themselves are compared.
    torch.manual_seed(5)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    hooks = _clipped_sums(_private(name, "hooks", 0.0, 0.05, 16), x, y)
    kept = _clipped_sums(_private(name, "bookkeeping", 0.0, 0.05, 16,
                                  channels_last=channels_last), x, y)
    assert len(hooks) == len(kept)
    for a, b in zip(hooks, kept, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    norm = torch.sqrt(sum(s.pow(2).sum() for s in kept))
    assert float(norm) <= 16 * 0.05 * (1 + 1e-5)  # a sum of 16 vectors of norm <= C


@pytest.mark.parametrize("name, way, clip", [
    ("char-gru", "instantiated", 0.05), ("char-gru", "gram", 0.05),
    ("char-lstm", "instantiated", 0.05), ("char-lstm", "gram", 0.05),
    ("char-transformer", "instantiated", 0.05), ("char-transformer", "gram", 0.05),
    ("resnet18", "instantiated", 0.05), ("resnet18", "conv-ghost", 0.05),
    ("resnet18", "conv-instantiated", 0.05),
    ("char-gru", "instantiated", 1e4), ("char-transformer", "gram", 1e4)])
def test_clipped_sum_beyond_the_cnns_equals_opacus_hooks(name, way, clip, monkeypatch):
    # Opacus' DPGRU/DPLSTM use each cell's Linear layers at every one of the 80 steps,
    # the transformer its Linear layers on whole sequences: book-keeping sums each
    # example's gradient over the steps (one batched product, or the Gram matrices of the
    # steps when the per-example copies would be too large) and gives Opacus' clipped
    # sum, embeddings (per-example norms from repeated characters), LayerNorm and the
    # ResNet's GroupNorm included; a clip of 0.05 clips every example, one of 1e4 none.
    from privacy.dp import bookkeeping

    if way == "gram":
        monkeypatch.setattr(bookkeeping, "INSTANTIATE_MAX_ELEMENTS", 0)
    if way.startswith("conv-"):  # every convolution by ghost norms, or none
        monkeypatch.setattr(bookkeeping, "ghost_cheaper", lambda *a: way == "conv-ghost")
    torch.manual_seed(5)
    x, y = _data(name, 6)
    hooks = _clipped_sums(_private(name, "hooks", 0.0, clip, 6), x, y)
    kept = _clipped_sums(_private(name, "bookkeeping", 0.0, clip, 6), x, y)
    assert len(hooks) == len(kept) == len(list(build_model(name, *_shape(name)).parameters()))
    for a, b in zip(hooks, kept, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    norm = torch.sqrt(sum(s.pow(2).sum() for s in kept))
    assert float(norm) <= 6 * clip * (1 + 1e-5)  # a sum of 6 vectors of norm <= C


class _Tokens(torch.nn.Module):
    """An embedding with a padding row, a Linear on the whole sequence (B, T, d) and a
    head: the layer shapes book-keeping meets outside the recurrent cells."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(12, 6, padding_idx=0)
        self.mix = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.relu(self.mix(self.embed(x))).mean(1))


@pytest.mark.parametrize("way", ["instantiated", "gram"])
def test_embedding_and_sequence_linear_clipped_sums_are_each_examples_own(way, monkeypatch):
    # each example's clipped gradient, from autograd on that example alone, summed: the
    # padding row gets nothing, a token repeated in a window adds its gradients in one row
    from privacy.dp import bookkeeping

    if way == "gram":
        monkeypatch.setattr(bookkeeping, "INSTANTIATE_MAX_ELEMENTS", 0)
    torch.manual_seed(3)
    model = _Tokens()
    x = torch.randint(0, 12, (5, 9))
    x[0, :4] = 0  # padding
    x[1, :] = 7  # one token, nine times
    y = torch.randint(0, 3, (5,))
    clip = 0.3
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(5):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad for p in model.parameters()]
        factor = min(1.0, clip / (float(torch.sqrt(sum(g.pow(2).sum() for g in grads))) + 1e-6))
        expected = [e + factor * g for e, g in zip(expected, grads, strict=True)]
    assert float(expected[0][0].abs().max()) == 0.0
    wrapped = bookkeeping.BookKeeping(model)
    torch.nn.functional.cross_entropy(wrapped(x), y).backward()
    sums = wrapped.clipped_sums(clip)
    for e, s in zip(expected, sums, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-4, atol=1e-7)
    assert wrapped.remove() is model and all(p.requires_grad for p in model.parameters())


class _Reused(torch.nn.Module):
    """Every kind book-keeping covers, each used more than once in a pass and in every
    input shape it takes: an embedding on (B, T) and (B,) ids, a Linear on (B, T, d) and
    (B, 3, 3, d), LayerNorms without a bias and over two dimensions, a GroupNorm on
    (B, C), and a use under no_grad, which trains nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(12, 6, padding_idx=0)
        self.mix = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6, bias=False)
        self.block = torch.nn.LayerNorm((3, 6))
        self.group = torch.nn.GroupNorm(2, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.embed(x) + self.embed(x.flip(1))  # (B, 9, 6)
        h = self.norm(self.mix(h))
        h = self.norm(self.mix(torch.relu(h)))
        h = self.block(self.mix(h.view(-1, 3, 3, 6))).flatten(1, 2)
        with torch.no_grad():
            fixed = self.mix(h)  # a constant: no gradient reaches mix through this use
        h = h + fixed
        pooled = h.mean(1) + self.embed(x[:, 0])  # (B,) ids
        pooled = self.group(pooled) + self.group(2 * pooled)
        return self.head(pooled)


def _own_clipped_sums(model, x, y, clip):
    """Each example's gradient (autograd on that example alone, the loss a batch of one's
    mean) clipped to ``clip`` as Opacus does, summed over the batch."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad for p in model.parameters()]
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        total = [t + min(1.0, clip / (norm + 1e-6)) * g for t, g in zip(total, grads, strict=True)]
    return total


@pytest.mark.parametrize("way", ["instantiated", "gram"])
@pytest.mark.parametrize("clip", [0.3, 1e4])
def test_every_layer_used_many_times_gets_each_examples_own_clipped_sum(way, clip,
                                                                       monkeypatch):
    from privacy.dp import bookkeeping

    if way == "gram":
        monkeypatch.setattr(bookkeeping, "INSTANTIATE_MAX_ELEMENTS", 0)
    torch.manual_seed(4)
    model = _Reused().double()
    x = torch.randint(0, 12, (5, 9))
    x[0, :4] = 0
    x[1, :] = 7
    y = torch.randint(0, 3, (5,))
    expected = _own_clipped_sums(model, x, y, clip)
    wrapped = bookkeeping.BookKeeping(model)
    torch.nn.functional.cross_entropy(wrapped(x), y).backward()
    for e, got in zip(expected, wrapped.clipped_sums(clip), strict=True):
        torch.testing.assert_close(got, e, rtol=1e-9, atol=1e-12)
    empty = x[:0]  # an empty Poisson batch: nothing to add, and no NaN
    torch.nn.functional.cross_entropy(wrapped(empty), y[:0], reduction="sum").backward()
    assert all(float(s.abs().sum()) == 0.0 for s in wrapped.clipped_sums(clip))


def test_a_second_backward_pass_over_one_forward_is_named_not_summed():
    from privacy.dp.bookkeeping import BookKeeping

    wrapped = BookKeeping(_Tokens())
    x, y = torch.randint(0, 12, (4, 9)), torch.randint(0, 3, (4,))
    loss = torch.nn.functional.cross_entropy(wrapped(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="two gradients for one use"):
        wrapped.clipped_sums(1.0)


def test_bookkeeping_refuses_tied_weights():
    # an embedding table reused as the head's weight: the two layers' norms taken apart
    # would under-estimate each example's, |G_a|^2 + |G_b|^2 for |G_a + G_b|^2
    from privacy.dp.dpsgd import UnsupportedModelError

    model = _Tokens()
    model.head = torch.nn.Linear(6, 12, bias=False)
    model.head.weight = model.embed.weight
    x, y = torch.randint(0, 12, (8, 9)), torch.randint(0, 12, (8,))
    with pytest.raises(UnsupportedModelError, match="tied weights"):
        make_private(model, sgd(model, 0.1, 0.0), make_loader(x, y, 4, 0),
                     noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="bookkeeping")


def test_bookkeeping_refuses_a_layer_whose_input_is_not_batch_first():
    # a Linear on a (T, B, d) sequence would have each row credited to the example of its
    # position in the sequence: the clipping would bound the wrong quantity
    from privacy.dp.bookkeeping import BookKeeping

    class SequenceFirst(_Tokens):
        def forward(self, x):
            return self.head(torch.relu(self.mix(self.embed(x).transpose(0, 1))).mean(0))

    wrapped = BookKeeping(SequenceFirst())
    x = torch.randint(0, 12, (5, 9))
    with pytest.raises(RuntimeError, match="not the batch of 5"):
        wrapped(x)
    assert torch.isfinite(BookKeeping(_Tokens())(x)).all()


def test_bookkeeping_refuses_a_table_that_changes_in_the_forward_pass():
    from privacy.dp.bookkeeping import BookKeeping, supports

    model = _Tokens()
    assert supports(model)
    model.embed = torch.nn.Embedding(12, 6, max_norm=1.0)
    assert not supports(model)
    with pytest.raises(ValueError, match="Embedding"):
        BookKeeping(model)


def test_bookkeeping_char_gru_follows_opacus_hooks_step_for_step():
    # a whole epoch with noise: the same batches, noise draws and clipping as Opacus'
    # DPGRU under hooks, and the model comes back with torch's GRU, as the server built it
    def trained(mode):
        private = _private("char-gru", mode, 1.0, 0.5, 4, noise_seed=7)
        for xb, yb in private.loader:
            private.optimizer.zero_grad(set_to_none=True)
            private.criterion(private.model(xb), yb).backward()
            private.optimizer.step()
        assert private.mode == mode and private.swapped and not private.reusable
        model = private.module()
        assert isinstance(model.rnn, torch.nn.GRU)
        return model.state_dict()

    a, b = trained("hooks"), trained("bookkeeping")
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["small-cnn", "cnn"])
def test_noise_std_is_sigma_c_over_the_expected_batch(name):
    # The step's gradient is (clipped sum + N(0, (sigma C)^2 I)) / (q n): subtracting the
    # noise-free step on the same batch leaves the noise, whose std over every weight of
    # the model and three independent draws must be sigma C / (q n).
    sigma, clip, batch = 1.3, 0.7, 8
    torch.manual_seed(2)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    private = _private(name, "bookkeeping", sigma, clip, batch)
    opt = private.optimizer
    expected_batch = opt.expected_batch_size
    assert expected_batch == batch
    draws = []
    for _ in range(3):
        clean = [s / expected_batch for s in _clipped_sums(private, x, y)]
        opt.zero_grad(set_to_none=True)
        private.criterion(private.model(x), y).backward()
        assert opt.pre_step()  # the mechanism as training runs it: noise, scaling, accounting
        draws.append(torch.cat([(p.grad - c).flatten()
                                for p, c in zip(opt.params, clean, strict=True)]))
    noise = torch.stack(draws)
    expected = sigma * clip / expected_batch
    assert float(noise.std()) == pytest.approx(expected, rel=0.03 if name == "small-cnn"
                                               else 0.005)
    assert abs(float(noise.mean())) < 0.05 * expected
    corr = torch.corrcoef(noise)[0, 1:]
    assert corr.abs().max() < 0.05  # a fresh draw each step (the buffer is reused)
    assert private.history() == [(sigma, 0.25, 3)]


@pytest.mark.parametrize("noise_seed,channels_last,draw_ahead",
                         [(None, False, True), (7, False, True), (7, True, True),
                          (7, False, False)])
def test_bookkeeping_with_momentum_follows_opacus_hooks_step_for_step(noise_seed,
                                                                      channels_last,
                                                                      draw_ahead):
    # The noise is drawn in place into buffers kept across steps: with momentum (which
    # keeps a copy of past gradients) an epoch still equals Opacus' hooks, draws included.
    # With a noise generator of its own (as every client has), book-keeping draws the next
    # step's noise ahead on a worker thread when asked to: the same draws, in the same order.
    def trained(mode):
        private = _private("small-cnn", mode, 1.0, 0.5, 8, momentum=0.5,
                           noise_seed=noise_seed, channels_last=channels_last,
                           draw_ahead=draw_ahead)
        torch.manual_seed(1)
        for xb, yb in private.loader:
            private.optimizer.zero_grad(set_to_none=True)
            private.criterion(private.model(xb), yb).backward()
            private.optimizer.step()
        ahead = getattr(private.optimizer, "_ahead", None)
        assert (ahead is not None) == (mode == "bookkeeping" and noise_seed is not None
                                       and draw_ahead)
        return private.module().state_dict()

    a, b = trained("hooks"), trained("bookkeeping")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    if noise_seed is not None:  # and the noise is the seed's: another seed trains otherwise
        noise_seed += 1
        c = trained("bookkeeping")
        assert any(not torch.allclose(c[k], a[k], atol=1e-3) for k in a)


def test_rdp_epsilon_is_opacus_to_the_bit():
    from opacus.accountants import create_accountant

    for history in ([(1.0, 1 / 13, 13)], [(1.1, 0.125, 40), (0.9, 0.02, 300)]):
        acc = create_accountant("rdp")
        acc.history = list(history)
        assert epsilon(history, 1e-5, "rdp") == float(acc.get_epsilon(1e-5))


@pytest.mark.parametrize("name", ["small-cnn", "cnn", "char-gru"])
def test_an_empty_poisson_batch_is_a_noise_only_step(name):
    private = _private(name, "bookkeeping", 1.0, 1.0, 1)
    # (the plain model under the wrapper: private.module() would remove the hooks)
    before = {k: v.clone() for k, v in private.model._module.state_dict().items()}
    x, y = _data(name, 0)
    private.criterion(private.model(x), y).backward()
    private.optimizer.step()
    after = private.model._module.state_dict()  # (with Opacus' recurrent layers' names)
    # no example: each weight moves by lr N(0, (sigma C)^2) / (q n), lr 0.1, q n = 1
    delta = torch.cat([(after[k] - before[k]).flatten() for k in before])
    assert float(delta.std()) == pytest.approx(0.1, rel=0.05)
    assert private.history() == [(1.0, 0.25, 1)]


def test_a_forked_child_draws_noise_ahead_on_a_worker_of_its_own():
    # the parent's worker thread does not exist in a forked child; a child that reused its
    # executor would wait forever for its first draw
    import os

    from privacy.dp import background, bookkeeping

    bookkeeping._draw_ahead([torch.empty(10)], 1.0, torch.Generator().manual_seed(0)).result()
    assert "noise" in background._WORKERS
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by its exit status
        code = 3
        try:
            fresh = not background._WORKERS
            bookkeeping._draw_ahead([torch.empty(10)], 1.0,
                                    torch.Generator().manual_seed(1)).result(timeout=30)
            code = 0 if fresh else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-3)])
def test_bookkeepings_sgd_update_is_opacus_steps_to_the_bit(momentum, weight_decay,
                                                              monkeypatch):
    # book-keeping applies a plain SGD's update by torch's functional sgd, without
    # Optimizer.step's machinery: two epochs (noise, momentum and weight decay included)
    # must leave the weights and momentum buffers Opacus' own step leaves, to the bit
    from privacy.dp import bookkeeping

    plain_group, update = bookkeeping._plain_sgd_group, bookkeeping._sgd_update

    def trained(fast):
        calls = []
        monkeypatch.setattr(bookkeeping, "_plain_sgd_group",
                            plain_group if fast else lambda optimizer: None)
        monkeypatch.setattr(bookkeeping, "_sgd_update",
                            lambda *a: (calls.append(1), update(*a)))
        torch.manual_seed(0)
        model = build_model("small-cnn", (1, 28, 28), 10)
        convolutions_channels_last(model, torch.device("cpu"))
        x, y = _data("small-cnn", 32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum,
                              weight_decay=weight_decay)
        private = make_private(model, opt, make_loader(x, y, 8, 0), noise_multiplier=1.0,
                               max_grad_norm=0.5, grad_sample_mode="bookkeeping", seed=0,
                               noise_seed=3)
        for _ in range(2):
            for xb, yb in private.loader:
                private.optimizer.zero_grad(set_to_none=True)
                private.criterion(private.model(xb), yb).backward()
                private.optimizer.step()
        steps = private.history()[0][2]
        assert len(calls) == (steps if fast else 0)  # the path under test was taken
        buffers = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
        return private.module().state_dict(), buffers

    (fast, fast_buffers), (opacus, opacus_buffers) = trained(True), trained(False)
    for k in opacus:
        assert torch.equal(fast[k], opacus[k]), k
    assert all((a is None and b is None) or torch.equal(a, b)
               for a, b in zip(fast_buffers, opacus_buffers, strict=True))
    assert (fast_buffers[0] is None) == (momentum == 0)


def test_bookkeeping_leaves_an_sgd_with_hooks_to_its_own_step():
    # a step hook on the wrapped SGD (a scheduler's, a user's) runs: its Optimizer.step
    from privacy.dp import bookkeeping

    private = _private("small-cnn", "bookkeeping", 1.0, 0.5, 8)
    seen = []
    private.optimizer.original_optimizer.register_step_post_hook(
        lambda *a: seen.append(1))
    assert bookkeeping._plain_sgd_group(private.optimizer.original_optimizer) is None
    xb, yb = next(iter(private.loader))
    private.criterion(private.model(xb), yb).backward()
    private.optimizer.step()
    assert seen == [1]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_opacus_modes_get_nchw_convolutions_from_a_channels_last_model(mode):
    """Opacus' grad samplers misread channels-last convolutions (per-example gradients off
    by up to 0.1: clipping would not bound an example's contribution). make_private hands
    its modes the convolutions in NCHW, the same Parameters, and each example's gradient
    is then autograd's for that example alone."""
    from types import SimpleNamespace

    from tasks.training import client_optimizer

    torch.manual_seed(0)
    model = build_model("small-cnn", (1, 28, 28), 10)
    reference = build_model("small-cnn", (1, 28, 28), 10)
    reference.load_state_dict(model.state_dict())
    convolutions_channels_last(model, torch.device("cpu"))
    weight = model.features[3].weight
    assert not weight.is_contiguous()
    t = SimpleNamespace(client_optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    private = make_private(model, client_optimizer(model, t, for_opacus=True),
                           make_loader(x, y, 4, 0), noise_multiplier=0.0,
                           max_grad_norm=1e6, grad_sample_mode=mode, seed=0)
    assert weight.is_contiguous() and private.optimizer.params[2] is weight
    if mode == "hooks":
        private.criterion(private.model(x), y).backward()
        per = []
        for i in range(4):
            reference.zero_grad()
            torch.nn.functional.cross_entropy(reference(x[i:i + 1]), y[i:i + 1]).backward()
            per.append(reference.features[3].weight.grad.clone())
        torch.testing.assert_close(weight.grad_sample, torch.stack(per), rtol=1e-4, atol=1e-6)
