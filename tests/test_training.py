import torch

from tasks.models import build_model
from tasks.training import evaluate, make_loader, sgd, train_epochs

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
