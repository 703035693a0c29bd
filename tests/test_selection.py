"""Which modules a callback hooks: globs, types, predicates, the default, and the errors."""

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from torch.nn.utils.parametrize import register_parametrization

from lightning_hooks import ActivationMonitor
from lightning_hooks.core.selection import (
    ACTIVATION_NAMES,
    ACTIVATION_TYPES,
    is_default_module,
    named_parameters,
    select_modules,
    validate_selection,
)
from tests.helpers import TinyNet, events, loader, trainer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout(0.1)


class MyLinear(nn.Linear):
    pass


class WithOwnParam(nn.Module):
    """Has a parameter of its own and a child holding none, so it is not a leaf but every parameter is its own."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.inner = nn.Identity()


class FusedExperts(nn.Module):
    """Its weights are its own (3-D, as transformers 5's ``MixtralExperts``), its one child an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.ones(2, 4, 4))
        self.act = nn.SiLU()


class OwnParamAndLayer(nn.Module):
    """A parameter of its own beside a child holding parameters: a container (a ViT's class token beside blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.ones(4))
        self.inner = nn.Linear(4, 4)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(4)
        self.frozen_bn = nn.BatchNorm1d(4, affine=False)  # buffers but no parameters
        self.gelu = nn.GELU()
        self.flat = nn.Flatten()
        self.mine = MyLinear(4, 2)
        self.own = WithOwnParam()
        self.prelu = nn.PReLU()
        self.experts = FusedExperts()


def names(selection, root=None):
    return [n for n, _ in select_modules(root or Model(), selection)]


def test_default_takes_leaves_with_parameters_and_activations():
    assert names(None) == [
        "encoder.0.lin", "encoder.0.relu", "encoder.1.lin", "encoder.1.relu",
        "norm", "gelu", "mine", "own", "prelu", "experts", "experts.act",
    ]  # not: containers, dropout, flatten, a norm without parameters; a module whose parameters are all its own
    # is a layer (an activation inside it is an activation)


def test_default_rule_module_by_module():
    assert is_default_module(nn.Linear(2, 2))
    assert is_default_module(nn.ReLU()) and is_default_module(nn.Softmax(dim=-1))
    assert not is_default_module(nn.Dropout())  # parameter-free, not an activation
    assert not is_default_module(nn.BatchNorm1d(4, affine=False))
    assert not is_default_module(nn.Sequential(nn.Linear(2, 2)))  # a container
    assert is_default_module(WithOwnParam()) and is_default_module(FusedExperts())  # every parameter its own
    assert not is_default_module(OwnParamAndLayer())  # own parameter, but a child with parameters: a container
    assert all(issubclass(t, nn.Module) for t in ACTIVATION_TYPES)


class NewGELUActivation(nn.Module):  # Hugging Face's name: a plain nn.Module
    def forward(self, x):
        return nn.functional.gelu(x, approximate="tanh")


class HardSwishMe(nn.Module):  # timm's name (timm.layers.activations_me)
    def forward(self, x):
        return nn.functional.hardswish(x)


class FeedForwardActivation(nn.Module):  # named like one, but a container
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


def test_did_you_mean_puts_the_closest_name_first():
    root = nn.Module()
    root.net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with pytest.raises(ValueError, match=r"'net.O' matched no .* Did you mean: 'net.0', 'net.1', 'net.2', 'net'\?"):
        names("net.O", root)  # difflib ties them; the look-alike O for 0 and the model's order break the tie


def test_library_activations_are_recognised_by_class_name_without_importing_the_library():
    assert is_default_module(NewGELUActivation()) and is_default_module(HardSwishMe())
    assert {"NewGELUActivation", "HardSwishMe"} - ACTIVATION_NAMES == {"NewGELUActivation"}  # by its suffix
    assert not is_default_module(FeedForwardActivation())  # its Linear is taken instead
    assert names(None, nn.Sequential(nn.Linear(2, 2), NewGELUActivation(), FeedForwardActivation())) == [
        "0", "1", "2.lin"]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("norm", ["norm"]),
        ("encoder.*", [  # '*' crosses dots: every module below encoder
            "encoder.0", "encoder.0.lin", "encoder.0.relu", "encoder.0.drop",
            "encoder.1", "encoder.1.lin", "encoder.1.relu", "encoder.1.drop",
        ]),
        ("encoder.?", ["encoder.0", "encoder.1"]),
        ("encoder.[1].lin", ["encoder.1.lin"]),
        ("*.relu", ["encoder.0.relu", "encoder.1.relu"]),
        ("*lin", ["encoder.0.lin", "encoder.1.lin"]),
        ("Norm", None),  # case-sensitive
    ],
)
def test_globs(pattern, expected):
    if expected is None:
        with pytest.raises(ValueError, match="matched no module"):
            names(pattern)
    else:
        assert names(pattern) == expected


def test_a_type_selects_instances_and_subclasses():
    assert names(nn.Linear) == ["encoder.0.lin", "encoder.1.lin", "mine"]
    assert names(MyLinear) == ["mine"]
    assert names(nn.Sequential) == ["encoder"]


def test_a_list_is_a_union_in_registration_order_without_duplicates():
    assert names([nn.ReLU, "norm", "encoder.0.*", nn.Linear]) == [
        "encoder.0.lin", "encoder.0.relu", "encoder.0.drop", "encoder.1.lin", "encoder.1.relu",
        "norm", "mine",
    ]
    assert names(("gelu",)) == ["gelu"]


def test_a_predicate_sees_names_and_modules():
    seen = []

    def wide_linears(name, module):
        seen.append(name)
        return isinstance(module, nn.Linear) and module.out_features == 4

    assert names(wide_linears) == ["encoder.0.lin", "encoder.1.lin"]
    assert "" not in seen and seen[0] == "encoder"  # the root is never offered


def test_the_root_is_never_selected():
    assert "" not in names("*")
    assert "" not in names(lambda name, module: True)
    assert names("*")[0] == "encoder"


def test_modules_come_with_their_objects():
    model = Model()
    (name, module), = select_modules(model, "encoder.1.lin")
    assert module is model.encoder[1].lin


def test_a_module_under_two_names_is_matched_by_either_and_reported_under_its_first():
    model = nn.Module()
    model.a = nn.Linear(2, 2)
    model.b = model.a  # tied: one module, two attribute names
    assert names(None, model) == ["a"]
    assert names(nn.Linear, model) == ["a"]
    assert select_modules(model, "b") == [("a", model.a)]
    assert names(["a", "b"], model) == ["a"]  # hooked once


def test_a_compiled_submodule_keeps_its_name():
    model = nn.Module()
    model.net = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), backend="eager")
    chosen = select_modules(model, None)
    assert [n for n, _ in chosen] == ["net.0", "net.1"]
    assert chosen[0][1] is model.net._orig_mod[0]
    assert names("net", model) == ["net"]  # the compiled model, not torch's wrapper around it
    assert select_modules(model, "net")[0][1] is model.net._orig_mod


def test_a_checkpoint_wrapped_submodule_keeps_its_name_and_so_do_its_parameters():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), nn.ReLU())
    chosen = select_modules(model, None)
    assert [n for n, _ in chosen] == ["0", "1"]
    assert chosen[0][1] is model[0]._checkpoint_wrapped_module  # the layer, not the wrapper
    assert [n for n, _ in named_parameters(model)] == ["0.weight", "0.bias"]
    assert [n for n, _ in model.named_parameters()] == ["0._checkpoint_wrapped_module.weight",
                                                       "0._checkpoint_wrapped_module.bias"]


# ---------------------------------------------------------------- errors


def test_no_match_lists_close_names_and_all_names():
    with pytest.raises(ValueError, match=r"pattern 'encoder.0.lni' matched no module\.") as err:
        names("encoder.0.lni")
    message = str(err.value)
    assert "Did you mean: 'encoder.0.lin'" in message
    assert "Available modules: 'encoder', 'encoder.0', 'encoder.0.lin'" in message
    assert "fnmatch globs" in message


def test_no_match_without_close_names_still_lists_the_modules():
    with pytest.raises(ValueError, match=r"pattern 'zzz' matched no module\. Available modules: 'encoder'"):
        names("zzz")


def test_one_bad_item_of_a_list_is_named():
    with pytest.raises(ValueError, match=r"pattern 'nrom' matched no module\. Did you mean: 'norm'"):
        names(["encoder.*", "nrom"])


def test_a_type_the_model_lacks():
    with pytest.raises(ValueError, match=r"names type Conv2d, but the model holds no Conv2d\. Available"):
        names(nn.Conv2d)


def test_a_predicate_that_selects_nothing():
    with pytest.raises(ValueError, match=r"selected no module of Model\. Available modules: 'encoder'"):
        names(lambda name, module: False)


def test_long_module_lists_are_shortened():
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(40)])
    with pytest.raises(ValueError, match=r"'29', \.\.\. \(10 more\)\.") as err:
        names("nope", model)
    assert "'30'" not in str(err.value)


@pytest.mark.parametrize(
    ("selection", "error", "match"),
    [
        (3, TypeError, r"`modules` must be None, a name glob like 'encoder.\*'.*got 3"),
        ({"a": 1}.keys(), TypeError, "`modules` must be None"),
        ([], ValueError, "`modules` is an empty list: pass None for the default selection"),
        ("", ValueError, "`modules` holds an empty pattern ''"),
        (["encoder.*", ""], ValueError, "empty pattern"),
        ([nn.Linear, 3], TypeError, r"`modules` items must be name globs or nn.Module subclasses, got 3"),
        (int, TypeError, "items must be name globs or nn.Module subclasses, got <class 'int'>"),
        ([str], TypeError, "got <class 'str'>"),
    ],
)
def test_malformed_selections_fail_before_any_model(selection, error, match):
    with pytest.raises(error, match=match):
        validate_selection(selection)
    with pytest.raises(error, match=match):
        select_modules(Model(), selection)


@pytest.mark.parametrize("selection", [None, "a", nn.Linear, ["a", nn.ReLU], ("a",), lambda n, m: True])
def test_well_formed_selections_pass(selection):
    validate_selection(selection)


@pytest.mark.parametrize("norm", [weight_norm, spectral_norm])
@pytest.mark.parametrize("layer", [lambda: nn.Linear(4, 4), lambda: nn.Conv1d(4, 4, 3)])
def test_a_parametrized_layer_is_taken_whole_and_its_parametrization_list_never(norm, layer):
    model = nn.Sequential(norm(layer()), nn.ReLU())
    assert [n for n, _ in select_modules(model, None)] == ["0", "1"]  # not '0.parametrizations.weight'
    assert not is_default_module(model[0].parametrizations.weight)  # its forward runs on every read of the weight


def test_nothing_inside_parametrizations_is_taken_even_an_activation_or_a_module_with_parameters():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight * self.scale

    layer = nn.Linear(4, 4)
    register_parametrization(layer, "weight", Scale())
    register_parametrization(layer, "bias", nn.Tanh())
    assert [n for n, _ in select_modules(nn.Sequential(layer), None)] == ["0"]


def test_a_weight_normed_layer_logs_its_output_once_a_step(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    model.net[0] = weight_norm(model.net[0])
    monitor = ActivationMonitor(stats=["mean", "calls"])
    trainer(tmp_path, [monitor], logger=TensorBoardLogger(tmp_path), max_steps=3).fit(model, loader())
    scalars = events(str(tmp_path)).Tags()["scalars"]
    assert {t.rpartition("/")[0] for t in scalars} == {"activations/net.0", "activations/net.1", "activations/net.2"}
    calls = events(str(tmp_path)).Scalars("activations/net.0/calls")
    assert [(e.step, e.value) for e in calls] == [(0, 1.0), (1, 1.0), (2, 1.0)]  # one forward a step, no weight reads
