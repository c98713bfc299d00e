import torch

from tasks.models import build_model
from tasks.training import (
    convolutions_channels_last,
    evaluate,
    make_loader,
    sgd,
    train_epochs,
)

CPU = torch.device("cpu")


def _toy(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return x, y


def test_training_learns_a_separable_problem():
    torch.manual_seed(0)
    x, y = _toy()
    model = build_model("mlp", (10,), 2, (16,))
    before = evaluate(model, x, y, 64, CPU)
    result = train_epochs(model, make_loader(x, y, 32, 0), sgd(model, 0.1, 0.5), 10, CPU)
    after = evaluate(model, x, y, 64, CPU)
    assert result.examples == 2560 and result.steps == 80
    assert after[0] < before[0] and after[1] > 0.9


def test_loader_order_depends_only_on_seed():
    x, y = _toy(50)
    first = [b[1].tolist() for b in make_loader(x, y, 8, 3)]
    again = [b[1].tolist() for b in make_loader(x, y, 8, 3)]
    other = [b[1].tolist() for b in make_loader(torch.clone(x), y, 8, 4)]
    assert first == again and first != other


def test_fedprox_term_keeps_weights_near_the_global_model():
    x, y = _toy()

    def drift(mu):
        torch.manual_seed(0)
        model = build_model("mlp", (10,), 2, (16,))
        start = [p.detach().clone() for p in model.parameters()]
        train_epochs(model, make_loader(x, y, 32, 0), sgd(model, 0.1), 5, CPU, proximal_mu=mu)
        pairs = zip(model.parameters(), start, strict=True)
        return sum(((p - s) ** 2).sum().item() for p, s in pairs)

    assert drift(10.0) < 0.5 * drift(0.0)


def test_evaluate_counts_correct_predictions():
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 1])
    loss, acc = evaluate(model, x, y, 3, CPU)
    assert acc == 0.75 and loss > 0


def test_loader_gives_the_batches_of_a_plain_tensor_dataloader_epoch_after_epoch():
    """Rows fetched a batch at a time: the same tensors, in the same order, as the
    DataLoader over a TensorDataset with the same generator (across epochs of one loader,
    a last short batch, and the canary ids' third tensor)."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.randn(77, 1, 4, 4), torch.randint(0, 10, (77,))
    ids = torch.full((77,), -1)
    ids[5] = 0
    for tensors, batch, seed in (((x, y), 32, 3), ((x, y, ids), 10, 11), ((x, y), 100, 5)):
        ours = make_loader(*tensors[:2], batch, seed, *tensors[2:])
        plain = DataLoader(TensorDataset(*tensors), batch_size=batch, shuffle=True,
                           generator=torch.Generator().manual_seed(seed))
        for _ in range(3):
            pairs = list(zip(ours, plain, strict=True))
            for a, b in pairs:
                assert len(a) == len(b) == len(tensors)
                for u, v in zip(a, b, strict=True):
                    assert u.dtype == v.dtype and u.is_contiguous()
                    assert torch.equal(u, v)


def test_functional_sgd_takes_torch_sgds_steps_bit_for_bit():
    """A plain client's SGD (no torch Optimizer) against torch.optim.SGD: the same
    weights after three epochs, with and without momentum and weight decay, a frozen
    layer (no gradient), a layer that gets a gradient only from the second epoch on
    (its momentum starts then, as torch's does) and gradients zeroed in place."""
    from types import SimpleNamespace

    from tasks.training import FunctionalSGD, client_optimizer

    x, y = torch.randn(90, 1, 28, 28), torch.randint(0, 10, (90,))
    for name, momentum, decay, in_place in (("small-cnn", 0.0, 0.0, False),
                                            ("small-cnn", 0.5, 0.0, False),
                                            ("mlp", 0.9, 1e-3, True)):
        torch.manual_seed(0)
        ours = build_model(name, (1, 28, 28), 10)
        theirs = build_model(name, (1, 28, 28), 10)
        theirs.load_state_dict(ours.state_dict())
        frozen = [list(m.parameters())[0] for m in (ours, theirs)]
        late = [list(m.parameters())[-1] for m in (ours, theirs)]
        for p in frozen:
            p.requires_grad_(False)
        start = late[0].detach().clone()
        t = SimpleNamespace(client_optimizer="sgd", lr=0.05, momentum=momentum,
                            weight_decay=decay)
        opt = client_optimizer(ours, t)
        assert isinstance(opt, FunctionalSGD)
        ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum,
                              weight_decay=decay)
        for epoch in range(3):
            for p in late:
                p.requires_grad_(epoch > 0)
            for model, o in ((ours, opt), (theirs, ref)):
                for xb, yb in make_loader(x, y, 32, epoch):
                    o.zero_grad(set_to_none=not in_place)
                    torch.nn.functional.cross_entropy(model(xb), yb).backward()
                    o.step()
        for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(),
                        strict=True):
            assert torch.equal(a, b), name
        assert not torch.equal(late[0], start)  # it did train, from the second epoch
    t = SimpleNamespace(client_optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0)
    assert isinstance(client_optimizer(ours, t, for_opacus=True), torch.optim.SGD)


def test_a_plain_clients_training_builds_no_torch_optimizer():
    """torch.optim.Optimizer's constructor imports torch._dynamo (1.3 s of CPU in each
    process that builds one): a plain client's round must not."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, torch; from types import SimpleNamespace; "
            "from tasks.models import build_model; "
            "from tasks.training import client_optimizer, make_loader, train_epochs; "
            "m = build_model('small-cnn', (1, 28, 28), 10); "
            "t = SimpleNamespace(client_optimizer='sgd', lr=0.1, momentum=0.5, weight_decay=0); "
            "train_epochs(m, make_loader(torch.randn(40, 1, 28, 28), torch.randint(0, 10, (40,)), "
            "8, 0), client_optimizer(m, t), 1, torch.device('cpu')); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_plain_training_in_channels_last_is_the_same_sgd_summed_in_another_order():
    """Convolutions in channels-last layout (a plain client's CPU step): the same
    parameters, names and shapes, weights within float rounding of NCHW training's after
    two epochs, and the state dict reads the same whichever layout holds it; models
    without convolutions are left as they are.

    Rounded in another order, a max-pool's near-tie or a ReLU at zero can go the other
    way (in about one data draw of ten, measured over 30), which moves a few weights by
    up to 0.4% of their tensor's norm after two epochs: each tensor is compared by the
    norm of the difference, which a layout error would make as large as the tensor."""
    torch.manual_seed(0)  # the data fixed, whatever the tests before left in the generator
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    for name in ("small-cnn", "cnn"):
        torch.manual_seed(0)
        nchw = build_model(name, (1, 28, 28), 10)
        fast = build_model(name, (1, 28, 28), 10)
        fast.load_state_dict(nchw.state_dict())
        assert convolutions_channels_last(fast, CPU) is fast
        convs = [m.weight for m in fast.modules() if isinstance(m, torch.nn.Conv2d)]
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
        assert not convs[-1].is_contiguous()  # (the first, one channel in, is both)
        for model in (nchw, fast):
            train_epochs(model, make_loader(x, y, 16, 1), sgd(model, 0.05, 0.5), 2, CPU)
        a, b = nchw.state_dict(), fast.state_dict()
        assert list(a) == list(b)
        for k in a:
            assert a[k].shape == b[k].shape
            assert float((b[k] - a[k]).norm()) <= 1e-2 * float(a[k].norm()), k
            assert torch.equal(b[k].contiguous(), b[k])  # values, not layout
    mlp = build_model("mlp", (1, 28, 28), 10)
    before = [p.stride() for p in mlp.parameters()]
    assert [p.stride() for p in convolutions_channels_last(mlp, CPU).parameters()] == before
