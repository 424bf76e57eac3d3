"""The environment install.sh builds: no other installed distribution ships a top-level package under
one of our import names (kernels, shared, services, loadtest). One that did would be imported in our
package's place, or ours in its, depending on sys.path order: transformers 5.25 depends on the Hub's
`kernels` and then imported our kernels/ as its own (pyproject keeps transformers below it)."""

import importlib.metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OUR_PACKAGES = ("kernels", "shared", "services", "loadtest")


@pytest.mark.parametrize("name", OUR_PACKAGES)
def test_no_other_distribution_ships_one_of_our_top_level_packages(name: str):
    others = set(importlib.metadata.packages_distributions().get(name, [])) - {"tandem-serve", "tandem_serve"}
    assert not others, f"installed distributions {sorted(others)} ship a top-level {name!r} package, as we do"


@pytest.mark.parametrize("name", OUR_PACKAGES)
def test_our_import_names_resolve_to_this_checkout(name: str):
    module = __import__(name)
    assert Path(module.__file__).resolve().is_relative_to(REPO), module.__file__
