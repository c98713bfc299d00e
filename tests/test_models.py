import pytest
import torch
from opacus.validators import ModuleValidator

from tasks.config import KEYS, ConfigError
from tasks.models import McMahanCNN, build_model, count_parameters, resolve_model_name
from tasks.registry import BACKBONES, MODELS


def test_mcmahan_cnn_has_the_papers_parameter_count():
    assert count_parameters(McMahanCNN((1, 28, 28), 10)) == 1_663_370


def test_mlp_default_is_mcmahans_2nn():
    # 784*200+200 + 200*200+200 + 200*10+10
    assert count_parameters(build_model("mlp", (1, 28, 28), 10)) == 199_210
    assert count_parameters(build_model("linear", (64,), 10)) == 650


@pytest.mark.parametrize("name, shape, classes", [
    ("cnn", (1, 28, 28), 10), ("small-cnn", (1, 28, 28), 10), ("small-cnn", (3, 32, 32), 10),
    ("resnet18", (3, 32, 32), 100), ("resnet18", (1, 28, 28), 10), ("mlp", (30,), 2),
    ("cnn", (3, 32, 32), 10), ("linear", (64,), 10),
])
def test_models_forward_and_are_opacus_compatible(name, shape, classes):
    torch.manual_seed(0)
    model = build_model(name, shape, classes)
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, classes)
    assert ModuleValidator.validate(model, strict=False) == []
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_every_registered_name_is_allowed_by_the_schema_and_builds():
    assert KEYS["model"].choices == ("auto", *MODELS)
    assert KEYS["backbone"].choices == ("auto", *BACKBONES)
    for name in MODELS:
        if "text" in MODELS.info(name).reads:  # token ids
            x = torch.randint(0, 3, (2, 80))
            assert build_model(name, (80,), 3)(x).shape == (2, 3)
            continue
        shape = (64,) if name in ("mlp", "linear") else (1, 28, 28)
        assert build_model(name, shape, 3)(torch.randn(2, *shape)).shape == (2, 3)
    for name in BACKBONES:
        trunk = BACKBONES.load(name)((3, 32, 32), 10)
        assert trunk(torch.randn(2, 3, 32, 32)).flatten(1).shape[0] == 2


def test_auto_model_choice():
    assert resolve_model_name("auto", (1, 28, 28)) == "small-cnn"
    assert resolve_model_name("auto", (3, 32, 32)) == "resnet18"
    assert resolve_model_name("auto", (30,)) == "mlp"
    assert resolve_model_name("auto", (64,)) == "mlp"  # embeddings
    assert resolve_model_name("auto", (80,), "text") == "char-gru"


def test_image_model_on_tabular_data_is_explained():
    with pytest.raises(ConfigError, match="needs image input.*Use model = 'mlp'"):
        build_model("cnn", (30,), 2)
    with pytest.raises(ConfigError, match="at least 16x16"):
        build_model("small-cnn", (1, 8, 8), 2)
    with pytest.raises(ConfigError, match="unknown model 'vgg'.*linear"):
        MODELS.load("vgg")


def test_training_a_backbone_leaves_the_callers_random_stream_alone():
    # The server seeds torch, builds the test split's embeddings (training the backbone
    # when it is not cached yet), then draws the global model's initial weights: those must
    # not depend on whether the backbone was cached (they once did).
    from tasks.config import validate
    from tasks.embeddings import backbone_spec, load_backbone

    cfg = validate({"features": "embeddings", "backbone-epochs": 1, "seed": 3})
    torch.manual_seed(3)
    expected = torch.rand(4)
    for _ in ("trained or read from the cache", "read from the cache"):
        load_backbone.cache_clear()  # no in-process shortcut: the real path each time
        torch.manual_seed(3)
        load_backbone(backbone_spec(cfg.embeddings, cfg.data))
        assert torch.equal(torch.rand(4), expected)


def test_channels_last_pooling_is_bit_for_bit_torchs_pooling():
    """tasks.models.MaxPool2d only changes the layout torch pools in: outputs and
    gradients equal nn.MaxPool2d's exactly, ties (ReLU's zeros) included, inside and
    outside torch.func.vmap."""
    from torch.func import vmap

    from tasks.models import MaxPool2d

    gen = torch.Generator().manual_seed(0)
    for shape, kernel, stride in (((8, 16, 14, 14), 2, 1), ((5, 64, 14, 14), 2, 2),
                                  ((3, 32, 5, 5), 2, 1), ((4, 3, 9, 9), 2, 2)):
        x = torch.randn(shape, generator=gen).relu().requires_grad_()
        ours, theirs = MaxPool2d(kernel, stride), torch.nn.MaxPool2d(kernel, stride)
        upstream = torch.randn(theirs(x).shape, generator=gen)
        got, want = ours(x), theirs(x)
        assert got.is_contiguous() and torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got, x, upstream)[0],
                           torch.autograd.grad(want, x, upstream)[0])
        batched = torch.randn((2, *shape), generator=gen)
        assert torch.equal(vmap(ours)(batched), vmap(theirs)(batched))
        # the gradient of a gradient (what the inversion attacks take)
        second = [torch.autograd.grad((torch.autograd.grad(p(x), x, upstream,
                                                           create_graph=True)[0] * x).sum(),
                                      x)[0] for p in (ours, theirs)]
        assert torch.equal(*second)
