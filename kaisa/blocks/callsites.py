"""Call sites: where the recorder observes a curvature block, and the functional taps.

A block declares its call sites (:meth:`kaisa.blocks.CurvatureBlock.call_sites`), in a
fixed order; the recorder tells the block the index of the site each observation came
from. A :class:`CallSite` is one of

* a **module call** (``weight=None``): every call of ``module``; the input is the call's
  first positional argument, the output its return value. A block's default site is its
  own module; a block may list several modules (a weight tied between an ``nn.Embedding``
  and an output ``nn.Linear`` is one block observed through both);
* a **functional call** (``weight`` a parameter): every ``F.linear(x, w, b)`` made while
  ``module``'s forward runs whose ``w`` is ``weight`` or a row slice of it (a view, as
  ``weight.split``/``chunk`` give) containing the site's ``rows``. The input is ``x``, the
  output is the product, cut to the block's rows (output features) when the call computes
  more rows than the block covers (the k and v projections of one packed product). With
  ``index`` set, ``w`` is ``weight[index]``: one expert's matrix of a 3-D parameter
  holding every expert's (a mixture-of-experts layer); a grouped product
  (``torch._grouped_mm(x, weight.mT, offs=...)``, rows sorted by expert) is one
  observation per expert, of its rows.

Functional calls are seen by :class:`FunctionalTap`: a forward pre-hook on the module
pushes a ``TorchFunctionMode`` for the duration of the forward (a forward hook with
``always_call=True`` pops it, also when the forward raises), only while the recorder
records. The mode sees ``F.linear`` calls made in the forward directly. Some torch
functions hide their ``F.linear`` calls: ``F.multi_head_attention_forward`` dispatches to
the mode at its entry, and the mode is popped while it handles a call, so nested calls
never reach it. Those functions are *opened*: the mode runs a copy of the same function
object (same code, defaults and globals) whose global ``linear`` is a tap and whose helper
functions (``_in_projection_packed``, ``_in_projection``) are copied the same way. The
computation is the same function's, so the outputs are bit-identical; the tap only looks.
Inside an opened function, observations are given to blocks sequence-first, as
``(positions, N, features)`` with ``N`` the call's batch size (MHA's layout: its
``out_proj`` product flattens ``(L, N)`` into rows). Calls that each compute part of a
site's rows, together all of them, from one input (the same tensor data: torch's
unbatched self-attention projects ``query.unsqueeze(1)``, ``key.unsqueeze(1)`` and
``value.unsqueeze(1)`` with the three thirds of the packed weight) are one observation
whose output gradient is their gradients side by side (:func:`hook_outputs`). A call
whose rows overlap a site's rows otherwise (a self-attention block called as
cross-attention) records nothing for that site and is reported once.

``nn.MultiheadAttention``'s paths in torch 2.13, all inside
``F.multi_head_attention_forward``: ``_in_projection_packed`` with one product (query is
key is value), two (rows ``0:E`` on the query, ``E:3E`` on the key, which is the value) or
three (thirds, all different; also unbatched self-attention, above), ``_in_projection``
with the separate ``q/k/v_proj_weight``, and the ``out_proj`` product on either attention
branch (``need_weights`` or ``scaled_dot_product_attention``). The fast path
(``torch._native_multi_head_attention``) runs only in eval mode or without gradients, where
nothing is recorded and no mode is pushed, so it is untouched.
"""

from __future__ import annotations

import contextvars
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = ["CallSite", "Cut", "FunctionalTap", "hook_outputs"]

K = TypeVar("K")

_LINEAR = F.linear
#: The grouped product of mixture-of-experts layers (``F.grouped_mm`` dispatches to it).
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


@dataclass(frozen=True, eq=False)
class CallSite:
    """One place where a block is observed.

    Attributes:
        module: The module whose calls (or whose forward's ``F.linear`` calls) are observed.
        weight: ``None``: the module's own calls; a parameter: ``F.linear`` calls inside the
            module's forward that multiply by it (or by a row slice of it).
        rows: The rows of ``weight`` (output features) the block covers; ``None``: all.
        mismatch: What to warn (once) when a call uses part of ``rows`` only.
        index: The calls multiply by ``weight[index]`` (one expert of a 3-D ``weight``).
    """

    module: nn.Module
    weight: torch.Tensor | None = None
    rows: slice | None = None
    mismatch: str = ""
    index: int | None = None

    def row_range(self) -> tuple[int, int]:
        """``(start, stop)`` of the rows of ``weight`` the block covers."""
        if self.rows is not None:
            return self.rows.start, self.rows.stop
        return 0, 0 if self.weight is None else int(self.weight.shape[0])


class Cut(NamedTuple):
    """How one functional observation's tensors reach its block.

    Attributes:
        batch: Inside an opened function: the call's batch size ``N``; the rows become
            ``(positions, N)``. ``None``: the tensors as the call sees them.
        cols: The block's output features of the product, ``None``: all of them.
        rows: The rows of a grouped product that are the block's (one expert's tokens),
            ``None``: all of them.
    """

    batch: int | None
    cols: slice | None
    rows: slice | None = None

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """The observed input in the block's layout."""
        if self.rows is not None:
            x = x[self.rows]
        return x if self.batch is None else x.reshape(-1, self.batch, x.shape[-1])

    def grad(self, d: torch.Tensor) -> torch.Tensor:
        """The product's output gradient in the block's layout, cut to its features."""
        d = self.input(d)
        return d if self.cols is None else d[..., self.cols]


def hook_outputs(
    outputs: Sequence[torch.Tensor], hook: Callable[[torch.Tensor], None]
) -> None:
    """Calls ``hook`` with the gradient of ``outputs`` side by side (last dimension).

    One output: its own gradient hook. Several (the parts of one observation): each part's
    gradient is kept until every part's has arrived in the backward pass, then ``hook``
    gets them concatenated (once per backward pass).
    """
    if len(outputs) == 1:
        outputs[0].register_hook(hook)  # type: ignore[no-untyped-call]
        return
    grads: list[torch.Tensor | None] = [None] * len(outputs)

    def part(i: int) -> Callable[[torch.Tensor], None]:
        def keep(grad: torch.Tensor) -> None:
            grads[i] = grad
            if all(g is not None for g in grads):
                whole = torch.cat([g for g in grads if g is not None], dim=-1)
                grads[:] = [None] * len(grads)
                hook(whole)

        return keep

    for i, out in enumerate(outputs):
        out.register_hook(part(i))  # type: ignore[no-untyped-call]


class _Parts(NamedTuple):
    """Calls that each computed part of a site's rows, in one forward of the module."""

    key: Any
    site: CallSite
    x: torch.Tensor
    calls: list[tuple[int, int, torch.Tensor]]  # (start, stop, output)


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        and a.dtype == b.dtype and a.device == b.device
    )


#: The tap and the batch size of the opened function running now (``None``: none).
_CURRENT: contextvars.ContextVar[tuple[FunctionalTap[Any], int | None] | None] = (
    contextvars.ContextVar("kaisa_functional_tap", default=None)
)


def _tapped_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` as an opened function sees it: observed by the current tap."""
    current = _CURRENT.get()
    if current is None:
        return _LINEAR(input, weight, bias)
    tap, batch = current
    return tap.linear(input, weight, bias, batch)


class _Opened(NamedTuple):
    function: Callable[..., Any]
    batch: Callable[[tuple[Any, ...], dict[str, Any]], int | None]


def _open(function: Any, helpers: Sequence[Any]) -> Callable[..., Any]:
    """A copy of ``function`` (and its helpers) whose global ``linear`` is the tap."""
    scope = dict(function.__globals__)

    def copy(fn: Any) -> Any:
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__qualname__ = fn.__qualname__
        new.__doc__ = fn.__doc__
        return new

    opened = copy(function)
    # A re-dispatch inside the copy (an outer mode, a tensor subclass) comes back to it.
    scope[function.__name__] = opened
    for helper in helpers:
        scope[helper.__name__] = copy(helper)
    scope["linear"] = _tapped_linear
    return opened  # type: ignore[no-any-return]


def _mha_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    query = args[0] if args else kwargs["query"]
    return int(query.shape[1]) if query.dim() == 3 else 1


_OPENERS: dict[Any, tuple[Sequence[Any], Callable[[tuple[Any, ...], dict[str, Any]], int]]] = {
    F.multi_head_attention_forward: (
        (vars(F)["_in_projection_packed"], vars(F)["_in_projection"]), _mha_batch,
    ),
}
_OPENED: dict[Any, _Opened] = {}


def _opened(func: Any) -> _Opened | None:
    """The opened form of ``func``, made on first use; ``None`` for other functions."""
    opened = _OPENED.get(func)
    if opened is None and func in _OPENERS:
        helpers, batch = _OPENERS[func]
        opened = _OPENED[func] = _Opened(_open(func, helpers), batch)
    return opened


class _Mode(TorchFunctionMode):
    """The mode a :class:`FunctionalTap` pushes while its module's forward runs."""

    def __init__(self, tap: FunctionalTap[Any]) -> None:
        super().__init__()
        self.tap = tap

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR:
            return _linear_call(self.tap, None, *args, **kwargs)
        if func is _GROUPED_MM and func is not None:
            return self.tap.grouped(func(*args, **kwargs), args, kwargs)
        opened = _opened(func)
        if opened is None:
            return func(*args, **kwargs)
        token = _CURRENT.set((self.tap, opened.batch(args, kwargs)))
        try:
            return opened.function(*args, **kwargs)
        finally:
            _CURRENT.reset(token)


def _linear_call(
    tap: FunctionalTap[Any], batch: int | None, input: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return tap.linear(input, weight, bias, batch)


class FunctionalTap(Generic[K]):
    """Observes the ``F.linear`` calls of one module's forward for functional call sites.

    Args:
        module: The module.
        sites: ``(key, site)`` of every functional site on ``module``; ``key`` is what
            ``observe`` and ``mismatch`` are given.
        active: Whether a call of the module is to be observed (checked at its start).
        observe: Called with ``(key, input, outputs, cut)`` per observation (several
            outputs: parts of the site's rows, in row order; see :func:`hook_outputs`).
        mismatch: Called with ``(key, site)`` when calls use part of a site's rows (and
            not all of them from one input).
    """

    def __init__(
        self,
        module: nn.Module,
        sites: Sequence[tuple[K, CallSite]],
        *,
        active: Callable[[nn.Module], bool],
        observe: Callable[[K, torch.Tensor, tuple[torch.Tensor, ...], Cut], None],
        mismatch: Callable[[K, CallSite], None],
    ) -> None:
        self._module = module
        # Watched weights by the name under which the module holds them: FSDP2 swaps a
        # sharded parameter for its unsharded one around the forward, so the tensors the
        # calls multiply by are looked up at the start of each call (:meth:`_watch`).
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        self._named: dict[str, list[tuple[K, CallSite]]] = {}
        for key, site in sites:
            if site.weight is None or site.module is not module:
                raise ValueError("a functional tap takes the functional sites of its module")
            if id(site.weight) not in names:
                raise ValueError("a functional site's weight must be a parameter of its module")
            self._named.setdefault(names[id(site.weight)], []).append((key, site))
        self._params: dict[int, torch.Tensor] = {}
        self._sites: dict[int, list[tuple[K, CallSite]]] = {}
        self._watch()
        self._active = active
        self._observe = observe
        self._mismatch = mismatch
        self._modes: list[_Mode | None] = []
        self._parts: dict[int, _Parts] = {}
        self._retired = False

    def install(self) -> list[RemovableHandle]:
        """Puts the pre-hook and the (always called) forward hook on the module."""
        return [
            self._module.register_forward_pre_hook(self._enter),
            self._module.register_forward_hook(self._exit, always_call=True),
        ]

    def _watch(self) -> None:
        """Maps the tensors the module holds now under the watched names to their sites."""
        self._params.clear()
        self._sites.clear()
        for name, sites in self._named.items():
            owner, _, attr = name.rpartition(".")
            weight = getattr(self._module.get_submodule(owner), attr)  # maybe not a Parameter
            self._params[id(weight)] = weight
            self._sites[id(weight)] = sites

    def retire(self) -> None:
        """Makes a pending pre-hook call a no-op (its hooks are being removed mid-call)."""
        self._retired = True

    def enter(self) -> None:
        """What the pre-hook does, for a tap installed while its module's call starts."""
        self._enter(self._module, ())

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._retired:
            return
        if not self._modes:
            self._watch()
        mode = _Mode(self) if self._active(module) else None
        if mode is not None:
            mode.__enter__()  # type: ignore[no-untyped-call]
        self._modes.append(mode)

    def _exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        mode = self._modes.pop() if self._modes else None
        if mode is not None:
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        if not self._modes:
            parts, self._parts = self._parts, {}
            for key, site, _, _ in parts.values():  # never completed: not recorded
                self._mismatch(key, site)

    def linear(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, batch: int | None
    ) -> torch.Tensor:
        """``F.linear(x, w, b)``, observed for every site it serves."""
        out = _LINEAR(x, w, b)
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return out
        expert = self._expert(w)
        if expert is not None:
            param, index = expert
            for key, site in self._sites[id(param)]:
                if site.index == index:
                    self._observe(key, x, (out,), Cut(batch, None))
            return out
        found = self._rows(w)
        if found is None:
            return out
        param, start, stop = found
        for key, site in self._sites[id(param)]:
            if site.index is not None:
                continue
            r0, r1 = site.row_range()
            if start <= r0 and r1 <= stop:
                cols = None if (r0, r1) == (start, stop) else slice(r0 - start, r1 - start)
                self._observe(key, x, (out,), Cut(batch, cols))
            elif r0 <= start and stop <= r1:
                self._part(key, site, x, out, start, stop, batch)
            elif r0 < stop and start < r1:
                self._mismatch(key, site)
        return out

    def _part(self, key: K, site: CallSite, x: torch.Tensor, out: torch.Tensor, start: int,
              stop: int, batch: int | None) -> None:
        """Keeps a call that computed part of ``site``'s rows; observes the completed set."""
        parts = self._parts.setdefault(id(site), _Parts(key, site, x, []))
        if not _same_data(parts.x, x) or any(a < stop and start < b for a, b, _ in parts.calls):
            self._mismatch(key, site)  # another input (cross-attention), or rows twice
            parts.calls.clear()
            return
        parts.calls.append((start, stop, out))
        parts.calls.sort(key=lambda call: call[0])
        r0, r1 = site.row_range()
        edges = [r0] + [b for _, b, _ in parts.calls]
        if edges[-1] == r1 and all(a == edges[i] for i, (a, _, _) in enumerate(parts.calls)):
            del self._parts[id(site)]
            self._observe(key, parts.x, tuple(o for _, _, o in parts.calls), Cut(batch, None))

    def grouped(self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Observes a grouped product ``x (S, in) @ W^T`` (``out``), one expert at a time.

        ``W`` is a watched ``(experts, out, in)`` parameter and the rows of ``x`` are
        grouped by expert (``offs``: each group's end): one observation per expert with
        rows, of those rows. Reads ``offs`` on the host (one read a call).
        """
        x, w = [*args, None, None][:2]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        if not (isinstance(out, torch.Tensor) and out.requires_grad
                and isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
                and isinstance(offs, torch.Tensor) and x.dim() == 2 and w.dim() == 3):
            return out
        base = w._base
        param = None if base is None else self._params.get(id(base))
        if param is None or param.dim() != 3 or w.shape != param.mT.shape or (
                w.stride() != param.mT.stride()
                or w.storage_offset() != param.storage_offset()):
            return out  # not the transposed view of a watched (experts, out, in) parameter
        sites = {site.index: key for key, site in self._sites[id(param)]
                 if site.index is not None}
        start = 0
        for index, end in enumerate(offs.tolist()):
            if end > start and index in sites:
                self._observe(sites[index], x, (out,), Cut(None, None, slice(start, end)))
            start = end
        return out

    def _expert(self, w: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """``(parameter, index)`` when ``w`` is ``parameter[index]`` of a watched 3-D one."""
        base = w._base
        param = None if base is None else self._params.get(id(base))
        if (param is None or param.dim() != 3 or w.shape != param.shape[1:]
                or w.stride() != param.stride()[1:]):
            return None
        offset, step = w.storage_offset() - param.storage_offset(), param.stride(0)
        if step <= 0 or offset % step:
            return None
        return param, offset // step

    def _rows(self, w: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
        """``(parameter, start, stop)`` when ``w`` is a watched parameter or its rows."""
        param = self._params.get(id(w))
        if param is not None:
            return param, 0, int(w.shape[0])
        base = w._base
        param = None if base is None else self._params.get(id(base))
        if param is None or w.dim() != param.dim() or w.shape[1:] != param.shape[1:]:
            return None
        if w.stride() != param.stride():
            return None
        offset = w.storage_offset() - param.storage_offset()
        step = param.stride(0)
        if step <= 0 or offset % step:
            return None
        start = offset // step
        return param, start, start + int(w.shape[0])
