"""Named entries loaded on first use, with plugins found by `module:attribute` spec.

The operator's backends (`detlogp_jax.backends`) and the body's (`detlogp_jax.body.backends`)
are two `PluginRegistry` instances. A plugin lives outside the op core (the core never imports
it): its spec names a function that returns the entry. Specs come from the registry's
entry-point group of installed distributions and, for a source checkout that is not installed,
from its built-in specs; a plugin is imported on first use, and one that does not import is
registered as unavailable with the import error as its reason (`unavailable(name, spec, err)`
builds that entry).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Callable

__all__ = ["PluginRegistry"]


class PluginRegistry:
    """Entries of one kind (`what`, for messages), each registered by a loader that runs once."""

    def __init__(
        self,
        what: str,
        entry_type: type,
        entry_point_group: str,
        builtin_plugins: dict[str, str],
        unavailable: Callable[[str, str, str], Any],
    ):
        self.what = what
        self.entry_type = entry_type
        self.entry_point_group = entry_point_group
        self.builtin_plugins = dict(builtin_plugins)
        self.unavailable = unavailable
        self.loaders: dict[str, Callable[[], Any]] = {}
        self.loaded: dict[str, Any] = {}

    def register(self, name: str, loader: Callable[[], Any]) -> None:
        """Registers an entry lazily (`loader` runs on first use)."""
        self.loaders[name] = loader
        self.loaded.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered entries' names."""
        return tuple(self.loaders)

    def get(self, name: str):
        """The entry registered as `name` (ValueError naming the registered ones otherwise)."""
        if name not in self.loaders:
            raise ValueError(f"unknown {self.what} {name!r}; registered: {sorted(self.loaders)} or 'auto'")
        if name not in self.loaded:
            self.loaded[name] = self.loaders[name]()
        return self.loaded[name]

    def plugin_specs(self) -> dict[str, str]:
        """name -> "module:attribute" of every plugin known here (entry points override built-ins)."""
        specs = dict(self.builtin_plugins)
        try:
            for ep in importlib.metadata.entry_points(group=self.entry_point_group):
                specs[ep.name] = ep.value
        except Exception:  # pragma: no cover - broken metadata: keep the built-in specs
            pass
        return specs

    def plugin_loader(self, name: str, spec: str) -> Callable[[], Any]:
        """The loader of plugin `name`: imports `spec` and checks what its function returns."""

        def load():
            module, _, attr = spec.partition(":")
            try:
                entry = getattr(importlib.import_module(module), attr)
                made = entry() if callable(entry) else entry
            except Exception as e:  # not importable here: registered as unavailable
                return self.unavailable(name, spec, f"{type(e).__name__}: {e}")
            if not isinstance(made, self.entry_type) or made.name != name:
                raise TypeError(
                    f"{self.what} plugin {spec} must return a {self.entry_type.__name__} named {name!r}, got {made!r}"
                )
            return made

        return load

    def register_plugins(self) -> None:
        """Registers every plugin of `plugin_specs()`."""
        for name, spec in self.plugin_specs().items():
            self.register(name, self.plugin_loader(name, spec))
