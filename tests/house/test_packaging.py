"""The installed package holds every source package: pyproject.toml lists packages by hand (kernels/ and server/
are mapped under the jaxserve namespace), so a new sub-package left out of the list installs a jaxserve that
fails on import. A missing entry once shipped a build without jaxserve.quantization."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_source_package_is_installed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    for name, folder in setup["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            package = ".".join((name, *rel.parts))
            assert package in listed, f"{package} ({init.parent.relative_to(ROOT)}) is missing from pyproject's packages"
