"""Models on the ``meta`` device: build without memory, trace, probe, materialize one stage.

A model too large for one process is never built whole.  Its parameters live on ``meta``
(shape and dtype, no storage) until a rank or the profiler *materializes* the part it runs:

1. :func:`empty_parameters` builds it: inside the block every parameter a module registers is
   moved to ``meta`` (as ``accelerate.init_empty_weights`` does), whatever device it was made
   on, so ``nn.Parameter(torch.zeros(n, device="cpu"))`` does not escape.  Buffers stay real:
   they are small and often hold values no initializer recomputes (rotary frequency tables,
   ``position_ids``).  A model a user builds under ``torch.device("meta")`` also works; its
   buffers are then meta too and must be recomputed by an initializer (below).
2. :func:`trace_meta` traces it.  Tracing on ``meta`` tensors is not the same as tracing on
   the device (meta kernels choose other strides, so ``torch.export`` records other nodes);
   so parameters, buffers and inputs are replaced, for the trace, by fake tensors of the
   device (``FakeTensorMode``) and the graph gets the real objects back afterwards.  The graph
   and its fingerprint are those of the same model built for real.
3. :class:`MetaInterpreter` runs a graph on ``meta`` values: shapes, dtypes,
   ``requires_grad`` and non-tensor values (sizes) without memory or time.
4. :func:`materialize` gives real storage to the modules that own the named tensors, on the
   device, and initialises them.  Tensors are swapped in place
   (:func:`torch.utils.swap_tensors`), so every holder sees them, the traced graph and the
   stage modules included, and a tied parameter (one object under two names) stays tied; a
   plain ``module.to_empty()`` makes two parameters of it.  :func:`dematerialize` puts the
   parameters of such modules back on ``meta`` (the profiler measures one unit at a time).

The initialisation contract.  For each module that owns a materialized tensor, in
``named_modules`` order, the random generator is seeded from ``(seed, the module's qualified
name)`` and the first that applies runs:

- the model's own hook, ``ModelSpec.init_weights(module)`` (:mod:`pipeplan.intake.model`);
- a ``transformers`` model's ``_init_weights(module)`` (it also recomputes rotary tables);
- the module's ``reset_parameters()``.

The values depend on the seed and the module's name alone, so a stage materialized alone gets
exactly what it gets when the whole model is materialized with the same seed.  New storage is
filled with NaN first, and a floating-point tensor still NaN afterwards is one that nothing
initialises: :class:`~pipeplan.planner.errors.ModelLoadError` names it.  A checkpoint
(:mod:`pipeplan.runtime.checkpoint`) replaces the initialisation.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Interpreter
from torch.utils._pytree import tree_map

from pipeplan.planner.errors import ModelLoadError

__all__ = [
    "InitFn",
    "MetaInterpreter",
    "dematerialize",
    "empty_parameters",
    "has_meta",
    "materialize",
    "module_seed",
    "owners",
    "trace_meta",
    "uninitialised",
]

META = torch.device("meta")

InitFn = Callable[[nn.Module], None]
"""A user's initializer of one module's own parameters and buffers (in place)."""


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Inside the block, parameters are created on ``meta``; buffers stay real.

    >>> with empty_parameters():
    ...     layer = nn.Linear(4096, 4096)
    >>> layer.weight.device, layer.weight.shape
    (device(type='meta'), torch.Size([4096, 4096]))
    """
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            moved = type(p)(p.to(META), requires_grad=p.requires_grad)
            moved.__dict__.update(p.__dict__)
            self._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on ``meta``."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _slots(module: nn.Module) -> Iterator[tuple[dict[str, Any], str, Tensor]]:
    """Every (dict, key, tensor) parameter and buffer slot of every submodule, aliases too."""
    for mod in module.modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for key, t in list(table.items()):
                if t is not None:
                    yield table, key, t


def trace_meta(module: nn.Module, example_inputs: tuple[Tensor, ...], tracer: str = "auto") -> Any:
    """:func:`pipeplan.intake.trace.trace_model` of a model whose tensors may be on ``meta``.

    Every parameter, buffer and input is a fake tensor on ``device`` (the inputs') during the
    trace, so the graph is the one the real model gives; afterwards the module and the graph
    hold the original objects again.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipeplan.intake.trace import trace_model

    device = next((x.device for x in example_inputs if not x.is_meta), torch.device("cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, tuple[Tensor, Tensor]] = {}

    def fake(t: Tensor) -> Tensor:
        if id(t) not in fakes:
            with mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            fakes[id(t)] = (f, t)
        return fakes[id(t)][0]

    saved = [(table, key, t) for table, key, t in _slots(module)]
    for table, key, t in saved:
        table[key] = fake(t)
    inputs = tuple(
        mode.from_tensor(x)
        if not x.is_meta
        else fake(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=META))
        for x in example_inputs
    )
    try:
        traced = trace_model(module, inputs, tracer)  # type: ignore[arg-type]
    finally:
        for table, key, t in saved:
            table[key] = t
    real = {id(f): t for f, t in fakes.values()}
    for table, key, t in _slots(traced.gm):
        table[key] = real.get(id(t), t)
    from torch._subclasses.fake_tensor import FakeTensor

    held = [*vars(traced.gm).items(), *traced.gm.named_buffers(), *traced.gm.named_parameters()]
    for name, value in held:
        if isinstance(value, FakeTensor) or (
            isinstance(value, Tensor) and name in vars(traced.gm) and id(value) not in real
        ):
            raise ModelLoadError(
                f"the traced graph holds a tensor constant {name!r} made in forward; it has no "
                f"value on meta: make it a buffer of the model, or build the model for real "
                f"(pipeplan run --init full, pipeplan profile --method whole)"
            )
    return traced


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor) and not value.is_meta:
        return value.detach().to(META).requires_grad_(value.requires_grad)
    if isinstance(value, torch.device):
        return META
    return value


def _meta_arg(value: Any) -> Any:
    """:func:`_to_meta`, and a graph passed to a higher-order operator
    (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``: what ``torch.export`` makes of a
    ``no_grad`` or ``autocast`` region) run by a :class:`MetaInterpreter` of its own, so that
    the device arguments inside it (``.to(x.device)``, baked in at the trace) go to ``meta``
    too."""
    if isinstance(value, GraphModule):
        return lambda *args: MetaInterpreter(value).run(*args)
    return _to_meta(value)


class MetaInterpreter(Interpreter):
    """Runs a graph with every tensor on ``meta``: real inputs, parameters and buffers are
    replaced by meta tensors of the same shape, dtype and ``requires_grad``, and device
    arguments (``arange(..., device=cpu)``) by ``meta``, inside the graphs of higher-order
    operators too.  A node that needs values (``.item()``, ``nonzero``) raises."""

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return tree_map(_to_meta, super().placeholder(target, args, kwargs))

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return tree_map(_to_meta, super().get_attr(target, args, kwargs))

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_function(target, tree_map(_meta_arg, args), tree_map(_meta_arg, kwargs))

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_method(target, tree_map(_to_meta, args), tree_map(_to_meta, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        sub = self.fetch_attr(target)
        state = {
            k: _to_meta(v)
            for k, v in [*sub.named_parameters(), *sub.named_buffers()]  # type: ignore[union-attr]
        }
        return torch.func.functional_call(
            sub, state, tuple(tree_map(_to_meta, args)), tree_map(_to_meta, kwargs)
        )


def module_seed(seed: int, name: str) -> int:
    """The generator's seed for module ``name`` (``""``: the root) under run seed ``seed``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def owners(module: nn.Module, names: Iterable[str]) -> list[str]:
    """The qualified names of the modules that directly own the tensors ``names`` (under any of
    their aliases), in ``named_modules`` order."""
    wanted = set(names)
    ids: set[int] = set()
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if name in wanted:
            ids.add(id(t))
    out: list[str] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        own = [*mod._parameters.values(), *mod._buffers.values()]
        if any(t is not None and id(t) in ids for t in own) and mod_name not in out:
            out.append(mod_name)
    return out


def _initializer(root: nn.Module, init_weights: InitFn | None) -> Callable[[nn.Module], bool]:
    """The first initializer of the contract (module docstring) that applies to a module.

    A ``transformers`` model anywhere in ``root`` (a user's wrapper holding one) initialises
    the modules inside it with its own ``_init_weights``."""
    from pipeplan.intake.spec import is_transformers_model

    hf_of: dict[int, nn.Module] = {}
    for mod in root.modules():  # pre-order: the outermost transformers model wins
        if is_transformers_model(mod) and id(mod) not in hf_of:
            for sub in mod.modules():
                hf_of.setdefault(id(sub), mod)

    def init(mod: nn.Module) -> bool:
        if init_weights is not None:
            init_weights(mod)
        elif (hf := hf_of.get(id(mod))) is not None:
            hf._init_weights(mod)  # type: ignore[operator]
        elif callable(getattr(mod, "reset_parameters", None)):
            mod.reset_parameters()  # type: ignore[operator]
        else:
            return False
        return True

    return init


def uninitialised(module: nn.Module, init_weights: InitFn | None = None) -> list[str]:
    """The ``cls.name`` of each ``meta`` parameter or buffer of ``module`` that no initializer
    of the contract reaches (its owner has no ``reset_parameters``, no hook, no
    ``transformers`` model above it): what a stage-local build would refuse.

    >>> with empty_parameters():
    ...     net = nn.Sequential(nn.Linear(2, 2))
    >>> net.register_parameter("token", nn.Parameter(torch.zeros(2, device="meta")))
    >>> uninitialised(net)
    ['Sequential.token']
    """
    if init_weights is not None:
        return []
    from pipeplan.intake.spec import is_transformers_model

    covered: set[int] = set()
    for mod in module.modules():
        if is_transformers_model(mod):
            covered.update(id(sub) for sub in mod.modules())
    out: list[str] = []
    for mod_name, mod in module.named_modules():
        if id(mod) in covered or callable(getattr(mod, "reset_parameters", None)):
            continue
        for key, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is not None and t.is_meta:
                out.append(f"{type(mod).__name__}.{f'{mod_name}.{key}' if mod_name else key}")
    return out


def materialize(
    module: nn.Module,
    names: Iterable[str],
    device: torch.device,
    *,
    seed: int = 0,
    init_weights: InitFn | None = None,
    initialize: bool = True,
) -> list[str]:
    """Give real storage on ``device`` to every tensor of the modules that own ``names``.

    Meta tensors get new storage; real ones (buffers) move to ``device``.  With
    ``initialize``, each such module is initialised as the module docstring says and any
    floating-point tensor left NaN raises :class:`~pipeplan.planner.errors.ModelLoadError`; without, the
    new storage is left for a checkpoint to fill.  Returns the owners' names.
    """
    mods = owners(module, names)
    by_name = dict(module.named_modules(remove_duplicate=False))
    fresh: dict[int, Tensor] = {}
    done: set[int] = set()
    with torch.no_grad():
        for mod_name in mods:
            mod = by_name[mod_name]
            for table in (mod._parameters, mod._buffers):
                for t in table.values():
                    if t is None or id(t) in done:
                        continue
                    done.add(id(t))
                    if not t.is_meta and t.device == device:
                        continue
                    if t.is_meta:
                        data = torch.empty(t.shape, dtype=t.dtype, device=device)
                        if data.is_floating_point() or data.is_complex():
                            data.fill_(float("nan"))
                        else:
                            data.zero_()
                        fresh[id(t)] = t
                    else:
                        data = t.detach().to(device)
                    new = (
                        nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                    )
                    torch.utils.swap_tensors(t, new)
                    t.__dict__.pop("_is_hf_initialized", None)  # transformers skips those
    if not initialize:
        return mods
    init = _initializer(module, init_weights)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for mod_name in mods:
            torch.manual_seed(module_seed(seed, mod_name))
            init(by_name[mod_name])
    _check_initialised(module, fresh, mods)
    return mods


def _check_initialised(module: nn.Module, fresh: dict[int, Tensor], mods: list[str]) -> None:
    """Raise naming the first new floating-point tensor of ``mods`` that is still NaN."""
    by_name = dict(module.named_modules(remove_duplicate=False))
    for mod_name in mods:
        mod = by_name[mod_name]
        for key, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is None or id(t) not in fresh or not t.is_floating_point():
                continue
            if bool(torch.isnan(t).any()):
                kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
                cls = type(mod).__name__
                name = f"{mod_name}.{key}" if mod_name else key
                raise ModelLoadError(
                    f"{kind} {name} ({cls}) has no values on the meta-built model: nothing "
                    f"initialises it ({cls} has no reset_parameters); give the ModelSpec an "
                    f"init_weights(module) hook, load a checkpoint with --weights, or run "
                    f"with --init full"
                )


def dematerialize(module: nn.Module, mods: Iterable[str], *also: nn.Module) -> None:
    """Put the parameters of the modules ``mods`` (qualified names, as :func:`materialize`
    returns them) back on ``meta``, in place, freeing their storage and gradients; buffers
    stay as they are (real, and small).

    A parameter that something outside Python still holds (a view of it kept alive by
    autograd, as a mixture-of-experts layer's transposed expert weights can be) cannot be
    swapped: it is replaced by a new ``meta`` parameter in every module of ``module`` and
    ``also`` that holds it, and its storage is freed once that holder lets go."""
    by_name = dict(module.named_modules(remove_duplicate=False))
    done: set[int] = set()
    stuck: dict[int, nn.Parameter] = {}
    for mod_name in mods:
        for p in by_name[mod_name]._parameters.values():
            if p is None or p.is_meta or id(p) in done:
                continue
            done.add(id(p))
            p.grad = None
            empty = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=META)
            new = nn.Parameter(empty, p.requires_grad)
            try:
                torch.utils.swap_tensors(p, new)
            except RuntimeError:
                new.__dict__.update(p.__dict__)
                stuck[id(p)] = new
    if stuck:
        for root in (module, *also):
            for table, key, t in list(_slots(root)):
                if id(t) in stuck:
                    table[key] = stuck[id(t)]
