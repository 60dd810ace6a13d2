"""Refuses a source distribution: the package maps seer.v1 in from ../../protos (the one generated
copy, see pyproject.toml), a path an sdist cannot carry (setuptools wrote the protos outside the
sdist's root and the wheel built from it failed: "package directory '../../protos/seer' does not
exist"). Wheels build from the checkout: `pip install ./clients/python`, `pip wheel
./clients/python`, `python -m build --wheel clients/python`."""

from __future__ import annotations

from setuptools import setup
from setuptools.command.sdist import sdist


class _NoSdist(sdist):
    def run(self) -> None:
        raise SystemExit("seer-client: no source distribution (seer.v1 is mapped in from ../../protos, which an "
                         "sdist cannot carry); build a wheel from the checkout: `pip wheel ./clients/python` or "
                         "`python -m build --wheel clients/python`")


setup(cmdclass={"sdist": _NoSdist})
