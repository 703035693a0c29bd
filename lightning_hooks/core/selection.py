"""Which modules a callback hooks: module types, name globs, or a predicate."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union

from torch import nn
from torch.nn.utils import parametrize

from lightning_hooks.core._validation import check_int

ModulePredicate = Callable[[str, nn.Module], bool]
# The order is for jsonargparse (LightningCLI): a class path such as torch.nn.Linear parses as a
# type before it falls back to a glob, and lists serialize only with the predicate last.
ModuleSelection = Union[None, type, str, Sequence[Union[type, str]], ModulePredicate]

#: Parameter-free modules selected by default, beside the modules that hold parameters of their own
#: (see :func:`is_default_module`).
ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus,
    nn.Softsign, nn.Softmax, nn.LogSoftmax, nn.GLU,
)

#: Class names of activation modules from libraries we do not import, whose classes are plain
#: ``nn.Module`` subclasses rather than torch's (the default selection takes a leaf module of one
#: of these names, or whose class name ends in ``Activation``: Hugging Face transformers'
#: ``NewGELUActivation``, ``GELUActivation``, ``SiLUActivation``, ``QuickGELUActivation`` ...):
#: transformers' ``GELUTanh`` and ``PytorchGELUTanh``, and timm's ``timm.layers.activations``
#: and ``activations_me`` modules.
ACTIVATION_NAMES: frozenset[str] = frozenset({
    "GELUTanh", "PytorchGELUTanh",
    "GELU", "QuickGELU", "Swish", "Mish", "Sigmoid", "Tanh", "HardSwish", "HardSigmoid", "HardMish",
    "SwishMe", "MishMe", "HardSwishMe", "HardSigmoidMe", "HardMishMe",
})


#: Modules taken whole by the default selection: their submodules are never called as modules
#: (``nn.MultiheadAttention`` uses ``out_proj``'s weights directly), so hooks on them never fire.
WHOLE_TYPES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def is_activation(module: nn.Module) -> bool:
    """Whether ``module`` is an activation module.

    One of ``ACTIVATION_TYPES`` (or a subclass), or a leaf module whose class name ends in
    ``Activation`` (Hugging Face's) or is one of ``ACTIVATION_NAMES`` (timm's): recognised by
    name, so that neither library is imported.
    """
    if isinstance(module, ACTIVATION_TYPES):
        return True
    name = type(module).__name__
    return (name.endswith("Activation") or name in ACTIVATION_NAMES) and next(module.children(), None) is None


def is_default_module(module: nn.Module) -> bool:
    """Whether the default selection takes ``module``.

    It takes activation modules (:func:`is_activation`), ``WHOLE_TYPES``, and every module whose
    parameters are all its own: one whose children hold none (a leaf module with parameters; or a
    layer with an activation inside: transformers 5's fused MoE experts, ``MixtralExperts``, keep
    their weights as 3-D parameters beside their ``act_fn``). A parametrized module
    (``torch.nn.utils.parametrizations.weight_norm``, ``spectral_norm`` ...) counts as a leaf: the
    parameters in its ``parametrizations`` are its own, and the ``ParametrizationList`` there, whose
    forward runs on every read of the weight, is never taken. Nor is a module whose only own
    parameter is an FSDP1 flat parameter (``use_orig_params=False``) beside children: it is a unit.

    Example::

        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> is_default_module(weight_norm(nn.Conv1d(2, 2, 3)))
        True
    """
    if isinstance(module, WHOLE_TYPES) or is_activation(module):
        return True
    if isinstance(module, parametrize.ParametrizationList):
        return False
    children = _children(module)
    if not children:
        return next(module.parameters(), None) is not None
    own = [p for name, p in module.named_parameters(recurse=False) if name != _FLAT_PARAM]
    if parametrize.is_parametrized(module):
        own += list(module.parametrizations.parameters())
    return bool(own) and all(next(child.parameters(), None) is None for child in children)


#: The name under which FSDP1 (``use_orig_params=False``) registers a unit's flat parameter.
_FLAT_PARAM = "_flat_param"


#: Containers whose repeated elements are the blocks of a stack: a transformer's layers, a ResNet stage's blocks.
STACK_TYPES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential)


def stack_blocks(root: nn.Module) -> set[int]:
    """The ``id`` of every block of a stack in ``root``: what a block adds to the residual stream, watched whole.

    A block is an element of an ``nn.ModuleList`` or ``nn.Sequential`` (behind any wrapper, see
    ``WRAPPED_ATTRIBUTES``) that holds parameters in its submodules, of a class that element
    repeats in the same container: GPT-2's ``transformer.h.<i>``, LLaMA's ``model.layers.<i>``, a
    ResNet stage's residual blocks. The default selection watches the modules inside it, whose
    outputs do not show what the block hands on: a residual stream scaled after the block's last
    layer moves no output inside it, and the next block's norms take the scale out. A list of
    experts (a container whose name holds ``expert``: ``experts``, ``local_experts``) is called in
    parallel, each on its tokens, not in a chain: its elements are not blocks.

    Example::

        >>> stack = nn.Sequential(*(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2)))
        >>> sorted(stack_blocks(nn.Sequential(stack, nn.Linear(2, 1)))) == sorted(map(id, stack))
        True
    """
    blocks: set[int] = set()
    for name, container in root.named_modules():
        if not isinstance(container, STACK_TYPES) or "expert" in name.rpartition(".")[2].lower():
            continue
        elements = [_unwrapped(child) for child in container.children()]
        classes = [type(e) for e in elements]
        blocks.update(id(e) for e in elements
                      if classes.count(type(e)) > 1 and _children(e) and not is_default_module(e)
                      and next(e.parameters(), None) is not None)
    return blocks


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module a wrapper (``torch.compile``'s, FSDP1's, activation checkpointing's) holds, or ``module``."""
    while (inner := _wrapped(module)) is not None:
        module = inner
    return module


def _children(module: nn.Module) -> list[nn.Module]:
    """``module``'s children, less the ``parametrizations`` of a parametrized module."""
    skip = module.parametrizations if parametrize.is_parametrized(module) else None
    return [child for child in module.children() if child is not skip]


def validate_selection(selection: ModuleSelection) -> None:
    """Check the shape of a selection before any model is known.

    Raises:
        TypeError: If ``selection`` is not None, a glob string, a module type, a predicate,
            or a sequence of globs and module types.
        ValueError: If ``selection`` is an empty sequence or holds an empty pattern.
    """
    if isinstance(selection, nn.Module):
        raise TypeError(
            f"`modules` got a module instance ({type(selection).__name__}); pass its qualified name"
            " instead, e.g. modules='encoder' or modules='encoder.*' for what is inside it"
        )
    if selection is None or (callable(selection) and not isinstance(selection, type)):
        return
    items = [selection] if isinstance(selection, (str, type)) else selection
    if not isinstance(items, Sequence):
        raise TypeError(
            "`modules` must be None, a name glob like 'encoder.*', an nn.Module subclass, a"
            f" predicate `(name, module) -> bool`, or a list of globs and types; got {selection!r}"
        )
    if len(items) == 0:
        raise ValueError("`modules` is an empty list: pass None for the default selection")
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ValueError("`modules` holds an empty pattern ''; use a glob such as 'encoder.*'")
        elif not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f"`modules` items must be name globs or nn.Module subclasses, got {item!r}")


def select_modules(
    root: nn.Module, selection: ModuleSelection, argument: str = "modules", blocks: bool = False
) -> list[tuple[str, nn.Module]]:
    """Resolve ``selection`` against ``root`` into ``(qualified_name, module)`` pairs.

    The root module itself is never selected. Each module appears once, under its first name in
    registration order, even when several patterns match it; a module registered under several
    names (a shared layer) is matched by any of them. A submodule wrapped by ``torch.compile``, FSDP1
    (``FullyShardedDataParallel``) or activation checkpointing keeps its own name: the wrapper
    is skipped and its ``_orig_mod``-style part is left out of the names below it.

    Args:
        root: The model, normally the LightningModule itself (never a DDP or FSDP wrapper).
        selection: None for the default (:func:`is_default_module`: the modules whose parameters
            are all their own, plus activation modules), a name glob (``"encoder.*"``), an
            ``nn.Module`` subclass, a predicate ``(name, module) -> bool``, or a list of globs and
            subclasses (their union). A glob or type never picks a module inside a parametrized
            module's ``parametrizations`` (its forward runs on every read of the weight).
        argument: The name of the argument the selection came from, for error messages.
        blocks: With the default selection, take each block of a stack too (:func:`stack_blocks`).

    Raises:
        ValueError: If a glob or type matches no module (the message lists close names), or
            the whole selection matches nothing.
    """
    validate_selection(selection)
    named = [
        (clean_name(name), m)
        for name, m in root.named_modules(remove_duplicate=False)
        if name and not _is_wrapper(m)
    ]
    names = list(dict.fromkeys(n for n, _ in named))
    # Nothing inside a parametrized module's ``parametrizations`` (a user's parametrization may be an
    # activation, or hold parameters): its forward runs on every read of the weight, not once a forward.
    inside = tuple(f"{n}.parametrizations" for n, m in named if parametrize.is_parametrized(m))
    if selection is None:  # nor inside a whole module
        wholes = tuple(f"{n}." for n, m in named if isinstance(m, WHOLE_TYPES)) + tuple(f"{p}." for p in inside)
        extra = stack_blocks(root) if blocks else set()
        chosen = [(n, m) for n, m in named if (is_default_module(m) or id(m) in extra) and not n.startswith(wholes)]
    elif callable(selection) and not isinstance(selection, type):
        chosen = [(n, m) for n, m in named if selection(n, m)]
    else:
        items = [selection] if isinstance(selection, (str, type)) else list(selection)
        outside = [(n, m) for n, m in named if not any(n == p or n.startswith(f"{p}.") for p in inside)]
        for item in items:
            if not any(_matches(item, n, m) for n, m in outside):
                raise ValueError(_no_match_message(argument, item, list(dict.fromkeys(n for n, _ in outside))))
        chosen = [(n, m) for n, m in outside if any(_matches(item, n, m) for item in items)]
    if not chosen:
        raise ValueError(
            f"`{argument}`={selection!r} selected no module of {type(root).__name__}."
            f" Available modules: {short_list(names)}"
        )
    first_names = {id(m): n for n, m in reversed(named)}
    return list({id(m): (first_names[id(m)], m) for _, m in chosen}.values())


def validate_limit(argument: str, value: Any) -> None:
    """Check a ``max_rows``-style argument: a positive int (not a bool) or None for no limit."""
    check_int(argument, value, optional=True, none_means="no limit")


def check_limit(owner: str, argument: str, limit: Optional[int], rows: int, tags_per_row: int,
                module_names: list[str]) -> None:
    """Raise, before training, when a callback would log more rows than ``limit`` allows.

    Args:
        owner: The callback, for the message (e.g. ``"ActivationMonitor"``).
        argument: The limit's argument name (e.g. ``"max_rows"``).
        limit: The most rows allowed, or None for no limit.
        rows: How many rows (modules or parameters) the callback would log.
        tags_per_row: How many tags each row logs at a logged step.
        module_names: The modules behind the rows, to suggest a narrower glob from.

    Raises:
        ValueError: If there are more than ``limit`` rows; the message says how many tags they
            would log and suggests a ``modules=`` glob built from the model's own names.
    """
    if limit is None or rows <= limit:
        return
    glob = _per_block_glob(module_names)
    example = f"modules={glob!r} for one module a block, " if glob else ""
    raise ValueError(
        f"{owner} would log {rows} rows ({rows * tags_per_row} tags a logged step), over `{argument}`={limit}:"
        f" too many charts to read, and slow for TensorBoard to load. Narrow `modules=` (e.g. {example}or"
        f" modules=nn.LayerNorm), or raise `{argument}` (None: no limit)."
    )


def _per_block_glob(names: list[str]) -> Optional[str]:
    """A glob taking one module a block: the first name with an index inside it, that index made ``*``.

    The index is not the name's last part: ``blocks.*`` of a block ``blocks.0`` would take everything in them.
    """
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        if index is not None:
            return ".".join([*parts[:index], "*", *parts[index + 1 :]])
    return None


#: The attribute under which a wrapper keeps the module it wraps: ``torch.compile``'s, FSDP1's
#: and activation checkpointing's. The wrapper is not a module of its own, and the attribute is
#: left out of names, so that tags are those of the model as written.
WRAPPED_ATTRIBUTES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _wrapped(module: nn.Module) -> Optional[nn.Module]:
    """The module ``module`` wraps (under one of ``WRAPPED_ATTRIBUTES``), or None when it is no wrapper."""
    return next((inner for attr in WRAPPED_ATTRIBUTES if isinstance(inner := getattr(module, attr, None), nn.Module)),
                None)


def _is_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is only a wrapper around another (see ``WRAPPED_ATTRIBUTES``)."""
    return _wrapped(module) is not None


def clean_name(name: str) -> str:
    """``name`` (of a module or a parameter) without the parts wrappers add, so tags do not change."""
    return ".".join(part for part in name.split(".") if part not in WRAPPED_ATTRIBUTES)


def named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` under the names of the model as written (see :func:`clean_name`)."""
    for name, param in module.named_parameters():
        yield clean_name(name), param


def _matches(item: str | type, name: str, module: nn.Module) -> bool:
    if isinstance(item, str):
        return fnmatch.fnmatchcase(name, item)
    return isinstance(module, item)


def _no_match_message(argument: str, item: str | type, names: list[str]) -> str:
    if isinstance(item, type):
        return (
            f"`{argument}` names type {item.__name__}, but the model holds no {item.__name__}."
            f" Available modules: {short_list(names)}"
        )
    close = close_matches(item, names)
    hint = f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"`{argument}` pattern {item!r} matched no module.{hint}"
        f" Available modules: {short_list(names)}. Patterns are fnmatch globs over"
        " qualified names, e.g. 'encoder.*' or '*.relu'."
    )


#: Characters a name typed by hand confuses with digits: 'net.O' means 'net.0'.
_LOOKALIKES = str.maketrans({"O": "0", "o": "0", "I": "1", "l": "1"})


def close_matches(name: str, names: list[str], n: int = 5, cutoff: float = 0.5) -> list[str]:
    """The ``n`` of ``names`` most like ``name`` (difflib's ratio at least ``cutoff``), the closest first.

    Ties go to the name that is closer once look-alike characters are read as digits (``O`` as
    ``0``, ``l`` as ``1``), then to the one that comes first in ``names`` (the model's order),
    where ``difflib.get_close_matches`` puts the last first.
    """
    plain = name.translate(_LOOKALIKES)

    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    scored = [(ratio(name, other), ratio(plain, other.translate(_LOOKALIKES)), other) for other in names]
    ranked = sorted((s for s in scored if s[0] >= cutoff), key=lambda s: (-s[0], -s[1]))
    return [other for _, _, other in ranked[:n]]


def short_list(names: list[str], limit: int = 30) -> str:
    """``names`` quoted and joined, the first ``limit`` of them, with how many more there are."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
