"""The API reference's cross-references: the docstrings' Sphinx roles as links (a griffe extension, mkdocs.yml).

The docstrings name other objects with Sphinx roles — ``:func:`~flatbma.predict.evaluate```, ``:class:`BMA```,
``:meth:`save``` — which mkdocstrings shows as literal text. This extension rewrites each role, when griffe has
loaded the package and before the docstrings are parsed, into what mkdocs-autorefs renders:

* a name that resolves to an object of the package — written in full, or relative to the docstring's object
  as Python would resolve it there (its members, its module's names and imports, the enclosing scopes) —
  becomes an optional autoref to that object: a link where the reference renders the object (the public API),
  its name in code where it does not (a private helper, the experiment layer);
* a name of another library (``torch.nn.Module``) stays code;
* a name under ``flatbma`` that resolves to nothing (a typo, an object moved or renamed) becomes a *required*
  autoref, which mkdocs-autorefs reports as unresolved: ``mkdocs build --strict`` (``make docs``) fails.

``~`` shows the last part of the name (Sphinx's rule), an explicit ``:func:`title <name>``` its title. Nothing
changes in the source: the docstrings keep the roles that editors and ``help()`` show.
"""

from __future__ import annotations

import builtins
import re
from typing import Any

import griffe

PACKAGE = "flatbma"
"""The package whose names must resolve (a role naming ``flatbma.x`` that is not there fails the build)."""

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|exc|obj|const|type):`(?P<body>[^`]+)`")
"""A Sphinx cross-reference role and its body (``~name``, ``name`` or ``title <name>``)."""


def convert(text: str, resolve: Any) -> str:
    """``text`` with every role replaced; ``resolve(name)`` gives ``(identifier, exists)`` or ``None`` (foreign)."""

    def replace(match: re.Match[str]) -> str:
        body = match["body"].strip()
        explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<name>[^>]+)>", body)
        name = (explicit["name"] if explicit else body).strip().removesuffix("()")
        short = name.startswith("~")
        name = name.lstrip("~.")
        title = explicit["title"] if explicit else (name.rsplit(".", 1)[-1] if short else name)
        code = f"<code>{title}</code>"
        found = resolve(name)
        if found is None:
            return code
        identifier, exists = found
        optional = " optional" if exists else ""
        return f'<autoref identifier="{identifier}"{optional}>{code}</autoref>'

    return ROLE.sub(replace, text)


def resolver(obj: griffe.Object, collection: griffe.ModulesCollection) -> Any:
    """``name -> (identifier, exists)`` in the scope of ``obj``; ``None`` for a name of another library."""

    def exists(path: str) -> bool:
        try:
            collection.get_member(path)
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return False
        return True

    def resolve(name: str) -> tuple[str, bool] | None:
        first, _, rest = name.partition(".")
        try:
            head = obj.resolve(first)  # a member, an import or a name of an enclosing scope
        except griffe.NameResolutionError:
            head = None
        candidates = [f"{head}.{rest}" if rest else head] if head is not None else []
        candidates += [name, f"{PACKAGE}.{name}"]
        for path in candidates:
            if path.split(".")[0] == PACKAGE and exists(path):
                return path, True
        owner = obj if obj.is_class else obj.parent
        if head is None and "." not in name and owner is not None and owner.is_class and owner.docstring is not None:
            if re.search(rf"^\s+{re.escape(name)}( \(.*\))?:", owner.docstring.value, flags=re.M):
                return f"{owner.path}.{name}", True  # an attribute its class documents (set as griffe cannot see)
        ours = (head or first).split(".")[0] == PACKAGE or exists(f"{PACKAGE}.{first}")
        if ours or (head is None and "." not in name and not hasattr(builtins, name)):
            return candidates[0], False  # a name of the package that is not there
        return None  # torch.Tensor, a builtin, another library's name

    return resolve


class SphinxRoles(griffe.Extension):
    """Rewrites the Sphinx roles of every docstring of the package into autorefs (module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Convert every docstring of ``pkg`` once it is loaded, before any is parsed."""
        if pkg.name != PACKAGE:
            return
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = convert(obj.docstring.value, resolver(obj, loader.modules_collection))


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined in it (aliases, i.e. imported names, are their own module's)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found.extend(_objects(member))  # type: ignore[arg-type]
    return found
