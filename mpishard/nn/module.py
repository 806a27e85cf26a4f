"""Module: a tree of parameters and sub-modules with stable dotted names.

Modeled on ``torch.nn.Module``: assigning a :class:`Parameter` or a
:class:`Module` to an attribute registers it, in assignment order, so
``named_parameters()`` yields nanoGPT's names (``transformer.h.0.mlp.c_fc.weight``).
Forward pre/post hooks are the coupling points strategies use (ZeRO-3 gathers a
unit's parameters in a pre-hook and releases them in a post-hook).
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from mpishard.autodiff.tensor import HookHandle
from mpishard.core.backend import to_numpy, xp_of
from mpishard.nn.parameter import Parameter

__all__ = ["Module", "ModuleList", "ModuleDict", "StateDictError"]


class StateDictError(KeyError):
    """``load_state_dict`` found missing, unexpected or mis-shaped entries."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Module:
    """Base class of every layer and model."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_forward_pre_hooks", [])
        object.__setattr__(self, "_forward_hooks", [])
        object.__setattr__(self, "training", True)

    # -- registration -------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call "
                                 f"super().__init__() before assigning {name!r}")
        params, modules = self.__dict__["_parameters"], self.__dict__["_modules"]
        # Re-assigning a name keeps its place, so named_parameters() keeps its order
        # when a layer is swapped (e.g. for its tensor-parallel version).
        if isinstance(value, Parameter):
            modules.pop(name, None)
            params[name] = value
        elif isinstance(value, Module):
            params.pop(name, None)
            modules[name] = value
        else:
            params.pop(name, None)
            modules.pop(name, None)
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        d = self.__dict__
        if name in d.get("_parameters", {}):
            return d["_parameters"][name]
        if name in d.get("_modules", {}):
            return d["_modules"][name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    # -- traversal ----------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """Yield ``(dotted_name, module)`` for this module and every descendant, depth first."""
        frozen = self.__dict__.get("_frozen")
        if frozen is not None and not prefix:
            yield from frozen
            return
        stack = [(prefix, self)]
        seen: set[int] = set()
        while stack:
            name, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            children = list(module._modules.items())
            for child_name, child in reversed(children):
                stack.append((f"{name}.{child_name}" if name else child_name, child))

    def freeze_structure(self) -> "Module":
        """Promise that no module or parameter below this one will be added, removed or
        replaced: its traversals are then computed once (a layout search walks the
        same stages thousands of times)."""
        self.__dict__["_frozen"] = list(self.named_modules())
        self.__dict__["_frozen_parameters"] = list(self.named_parameters())
        return self

    def structure_cache(self, name: str) -> dict:
        """A dict kept on a frozen module under ``name`` for answers that depend on its
        structure only (see :meth:`freeze_structure`); a fresh, forgotten one otherwise."""
        if "_frozen" not in self.__dict__:
            return {}
        return self.__dict__.setdefault(f"_cache_{name}", {})

    def get_submodule(self, path: str) -> "Module":
        """The module at dotted ``path`` (``""``: this one); KeyError naming the missing part."""
        module = self
        for part in path.split(".") if path else []:
            if part not in module._modules:
                raise KeyError(f"{type(self).__name__} has no module {path!r} "
                               f"({part!r} is not a child of {type(module).__name__})")
            module = module._modules[part]
        return module

    def set_submodule(self, path: str, module: "Module") -> None:
        """Replace the module at dotted ``path``; it keeps its place in the order."""
        parent, _, name = path.rpartition(".")
        owner = self.get_submodule(parent)
        if name not in owner._modules:
            raise KeyError(f"{type(self).__name__} has no module {path!r}")
        setattr(owner, name, module)

    def get_parameter(self, path: str) -> Parameter:
        """The parameter at dotted ``path`` (``"transformer.wte.weight"``)."""
        parent, _, name = path.rpartition(".")
        owner = self.get_submodule(parent)
        if name not in owner._parameters:
            raise KeyError(f"{type(self).__name__} has no parameter {path!r}")
        return owner._parameters[name]

    def children(self) -> Iterator["Module"]:
        return iter(self._modules.values())

    def named_parameters(self, prefix: str = "", remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, Parameter]]:
        """Yield ``(dotted_name, parameter)``; a tied parameter once, under its first name."""
        frozen = self.__dict__.get("_frozen_parameters")
        if frozen is not None and not prefix and remove_duplicate:
            yield from frozen
            return
        seen: set[int] = set()
        for mod_name, module in self.named_modules(prefix):
            for pname, p in module._parameters.items():
                if remove_duplicate:
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                yield (f"{mod_name}.{pname}" if mod_name else pname), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # -- modes and grads ----------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # -- state --------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Name -> array for every parameter, tied ones under each of their names (like torch)."""
        return {name: p.data for name, p in self.named_parameters(remove_duplicate=False)}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays into the parameters (cast to each parameter's dtype).

        Raises:
            StateDictError: listing every missing, unexpected and mis-shaped
                entry (with ``strict=False`` only mis-shaped ones).
        """
        own = dict(self.named_parameters(remove_duplicate=False))
        missing = [n for n in own if n not in state]
        unexpected = [n for n in state if n not in own]
        bad_shape = [f"{n}: expected {own[n].shape}, got {tuple(np.shape(state[n]))}"
                     for n in own if n in state
                     and tuple(np.shape(state[n])) != tuple(own[n].shape)]
        problems = []
        if strict and missing:
            problems.append("missing: " + ", ".join(missing))
        if strict and unexpected:
            problems.append("unexpected: " + ", ".join(unexpected))
        if bad_shape:
            problems.append("wrong shape: " + "; ".join(bad_shape))
        if problems:
            raise StateDictError(f"load_state_dict into {type(self).__name__}: "
                                 + " | ".join(problems))
        for name, p in own.items():
            if name not in state:
                continue
            value = state[name]
            if p.data is None:
                raise StateDictError(f"parameter {name} is not materialised; call "
                                     f"mpishard.nn.materialize() first")
            value = value.data if hasattr(value, "requires_grad") else value
            xp = xp_of(p.data)
            if xp is np:  # a device array comes to the host explicitly (CuPy refuses np.asarray)
                value = to_numpy(value)
            p.data[...] = xp.asarray(value, dtype=p.data.dtype)

    # -- forward and hooks --------------------------------------------------
    def register_forward_pre_hook(self, fn: Callable) -> HookHandle:
        """``fn(module, args)`` runs before ``forward``; it may return new args (a tuple)."""
        self._forward_pre_hooks.append(fn)
        return HookHandle(self._forward_pre_hooks, fn)

    def register_forward_hook(self, fn: Callable) -> HookHandle:
        """``fn(module, args, output)`` runs after ``forward``; it may return a new output."""
        self._forward_hooks.append(fn)
        return HookHandle(self._forward_hooks, fn)

    def __call__(self, *args, **kwargs):
        for hook in tuple(self._forward_pre_hooks):
            new_args = hook(self, args)
            if new_args is not None:
                args = new_args
        output = self.forward(*args, **kwargs)
        for hook in tuple(self._forward_hooks):
            new_output = hook(self, args, output)
            if new_output is not None:
                output = new_output
        return output

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, child in self._modules.items():
            child_repr = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {child_repr}")
        return "\n".join(lines) + (")" if len(lines) == 1 else "\n)")


class ModuleList(Module):
    """Modules named ``0``, ``1``, ... in order."""

    def __init__(self, modules=()):
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleDict(Module):
    """Named sub-modules, registered in the order given (an int key means its string)."""

    def __init__(self, **modules):
        super().__init__()
        for name, m in modules.items():
            setattr(self, name, m)

    def __getitem__(self, name) -> Module:
        return self._modules[str(name)]

    def __contains__(self, name) -> bool:
        return str(name) in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()
