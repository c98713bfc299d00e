"""Flower's records read, written and copied by tasks.records equal Flower's own; models
reused from the pool train to the same bits as freshly built ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from tasks import model_pool, records
from tasks.config import validate
from tasks.splits import client_split, model_for
from tasks.training import (
    client_optimizer,
    convolutions_channels_last,
    make_loader,
    train_epochs,
)

ARRAYS = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array(2.5),
          np.array([1, -2, 3], dtype=np.int64), np.array([[True, False]]),
          np.arange(6, dtype=np.uint8).reshape(2, 3), np.zeros((0, 5), np.float32),
          np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
          np.arange(10, dtype=np.float16)[::2]]


@pytest.mark.parametrize("a", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_written_and_read_as_flower_does(a: np.ndarray) -> None:
    ours, flowers = records.to_array(a), Array(a)
    assert (ours.dtype, tuple(ours.shape), ours.stype) == \
        (flowers.dtype, tuple(flowers.shape), flowers.stype)
    if a.flags.c_contiguous:  # np.save writes a Fortran-ordered array's own layout
        assert ours.data == flowers.data
    for read in (records.ndarray(ours), records.ndarray(flowers)):
        np.testing.assert_array_equal(read, a)
        assert read.dtype == a.dtype and read.flags.writeable


def test_other_dtypes_and_byte_orders_go_through_flower() -> None:
    big = np.arange(4, dtype=">f4")
    np.testing.assert_array_equal(records.ndarray(records.to_array(big)), big)
    np.testing.assert_array_equal(records.ndarray(Array(big)), big)
    cplx = np.array([1 + 2j], dtype=np.complex64)
    np.testing.assert_array_equal(records.ndarray(records.to_array(cplx)), cplx)
    # a payload that does not match its declared shape is read as Flower reads it (by its
    # own header), not at an offset guessed from the declared shape
    bad = Array(dtype="float32", shape=(5,), stype="numpy.ndarray",
                data=Array(np.arange(4, dtype=np.float32)).data)
    np.testing.assert_array_equal(records.ndarray(bad), bad.numpy())


def test_state_dicts_round_trip_as_flowers() -> None:
    model, _ = model_for(validate({}))
    state = model.state_dict()
    ours, flowers = records.array_record(state), ArrayRecord(state)
    assert list(ours) == list(flowers)
    assert all(ours[k].data == flowers[k].data for k in state)
    back = records.state_dict(flowers)
    assert list(back) == list(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert type(back) is dict and all(isinstance(v, torch.Tensor) for v in back.values())
    flowers_back = flowers.to_torch_state_dict()
    assert all(torch.equal(back[k], flowers_back[k]) for k in state)


def test_a_copy_shares_nothing_mutable() -> None:
    content = RecordDict({"arrays": ArrayRecord([np.ones(3, np.float32)]),
                          "metrics": MetricRecord({"loss": 0.5, "hist": [1, 2]}),
                          "config": ConfigRecord({"round": 1, "names": ["a", "b"]})})
    copy = records.copy_records(content)
    copy["metrics"]["hist"].append(3)
    copy["config"]["round"] = 2
    copy["arrays"]["0"].data = b""
    del copy["metrics"]
    assert content["metrics"]["hist"] == [1, 2] and content["config"]["round"] == 1
    np.testing.assert_array_equal(content["arrays"]["0"].numpy(), np.ones(3, np.float32))
    assert list(content) == ["arrays", "metrics", "config"]


def test_a_reused_model_trains_to_the_same_bits() -> None:
    """The pool's model (trained before, gradients left on it) and a fresh one, given the
    same state, seed and data, end with the same weights."""
    cfg = validate({})
    model_pool.clear()
    start = {k: v.clone() for k, v in model_for(cfg)[0].state_dict().items()}
    data = client_split(cfg, 0, 10)

    def trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        train_epochs(model, make_loader(data.x, data.y, 32, 7),
                     client_optimizer(model, cfg.training), 1, torch.device("cpu"))
        return {k: v.clone() for k, v in model.state_dict().items()}

    used = model_pool.take(cfg, start)
    trained(convolutions_channels_last(used, torch.device("cpu")))  # as a plain client
    assert not used.features[3].weight.is_contiguous()  # (the first, one channel in, is both)
    used.eval()  # gradients, moved weights and channels-last layout left behind
    model_pool.give(cfg, used)
    again = model_pool.take(cfg, start)
    assert again is used and again.training
    assert all(p.grad is None for p in again.parameters())
    assert all(v.is_contiguous() for v in again.state_dict().values())  # as built
    fresh, _ = model_for(cfg)
    fresh.load_state_dict(start)
    a, b = trained(again), trained(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)
    model_pool.clear()


@pytest.mark.parametrize("mode,kept", [("bookkeeping", True), ("hooks", False)])
def test_a_dp_sgd_model_is_reused_only_as_built(mode: str, kept: bool) -> None:
    """Book-keeping hands the model back as built (no hooks, no Opacus attributes), so it
    goes back to the pool, and the next round on it is the round on a fresh model, to the
    bit; Opacus' hooks stay on their model, which is never reused."""
    from flwr.app import Context, RecordDict

    from clients.update import Client, local_update

    cfg = validate({"dp": "local", "noise-multiplier": 1.0, "grad-sample-mode": mode})
    model_pool.clear()
    client = Client(cfg, 0, 10, client_split(cfg, 0, 10))
    state = model_for(cfg)[0].state_dict()

    def one_round() -> dict[str, torch.Tensor]:  # round 1 of a fresh client, each time
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        new_state, _ = local_update(client, ctx, state, {"server-round": 1})
        return new_state

    fresh = one_round()  # on a newly built model
    idle = [m for models in model_pool._IDLE.values() for m in models]
    assert len(idle) == int(kept)
    if kept:
        model = idle[0]
        assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
        assert all(p.requires_grad and p.grad is None and not hasattr(p, "summed_grad")
                   for p in model.parameters())
        reused = one_round()  # on the pool's model, given back again
        assert [m for models in model_pool._IDLE.values() for m in models] == [model]
        assert all(torch.equal(fresh[k], reused[k]) for k in fresh)
    model_pool.clear()
