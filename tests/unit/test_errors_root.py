"""rowrelay's one error root (resources/errors.py): every product exception derives from RowrelayError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from resources.errors import RowrelayError

_PACKAGES = ("orchestration", "assets", "resources")
# Not a product error: the warm launcher's signal that its fork server cannot serve a launch, caught in the launcher
# to fall back to Dagster's own launch; the run, not the user, meets it.
_NOT_PRODUCT = {"orchestration.launcher.ForkServerUnavailable"}

# Modules that do their work when imported (the code location loads rowrelay.yaml; a `__main__` runs its command
# line) and define no class.
_RUN_ON_IMPORT = {"orchestration.definitions"}


def _product_exceptions() -> dict[str, type[BaseException]]:
    """Every public exception class defined in a module of orchestration/, assets/ or resources/, by import and a
    walk of each module's names (the class's own module only, so a re-export is not counted twice)."""
    found: dict[str, type[BaseException]] = {}
    for package_name in _PACKAGES:
        package = importlib.import_module(package_name)
        modules = [package_name] + [m.name for m in pkgutil.walk_packages(package.__path__, f"{package_name}.")
                                    if m.name not in _RUN_ON_IMPORT and not m.name.endswith(".__main__")]
        for module_name in modules:
            module = importlib.import_module(module_name)
            for name, value in vars(module).items():
                if (inspect.isclass(value) and issubclass(value, BaseException) and not name.startswith("_")
                        and value.__module__ == module_name):
                    found[f"{module_name}.{name}"] = value
    return found


def test_every_product_exception_derives_from_the_one_root() -> None:
    found = _product_exceptions()
    assert "resources.exactly_once.errors.RelayError" in found and "resources.config.ConfigError" in found
    assert found.keys() >= _NOT_PRODUCT  # an exclusion that names nothing any more goes
    outside = sorted(name for name, cls in found.items()
                     if not issubclass(cls, RowrelayError) and name not in _NOT_PRODUCT)
    assert outside == [], f"derive these from resources.errors.RowrelayError: {outside}"


def test_the_root_keeps_each_error_under_its_builtin_base() -> None:
    """`except ValueError` / `except RuntimeError` written before the root still catch what they caught."""
    from resources.config import ConfigError
    from resources.exactly_once.replay import ReplayError
    from resources.jdbc import UrlParameterError
    from resources.slice_reads import SourceReadError
    from resources.source_database.errors import InnodbTrxStale, SchemaRaced, SourceError
    from resources.spark import SparkUnreachable

    for cls in (ConfigError, ReplayError, UrlParameterError, SourceError):
        assert issubclass(cls, ValueError) and issubclass(cls, RowrelayError)
    for cls in (SparkUnreachable, SourceReadError, SchemaRaced, InnodbTrxStale):
        assert issubclass(cls, RuntimeError) and issubclass(cls, RowrelayError)
