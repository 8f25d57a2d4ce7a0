"""Build hook of kvtier-client: the package ships the repository's top-level CUDA sources.

The page kernels' sources (kvtier_client.kernels compiles them at run time) live in the
repository's ``cuda/``, outside this distribution's directory. So that an installed package
carries them:

* ``build_py`` (wheels, ``pip install ./client``) copies ``../cuda/*.cu`` into the build's
  ``kvtier_client/cuda/``: a wheel holds ``kvtier_client/cuda/*.cu``.
* ``sdist`` puts them at ``kvtier_client/cuda/`` in the archive, where the package-data
  entry of pyproject.toml picks them up when a wheel is built from it (no ``../cuda`` there).
* An editable install (``pip install -e ./client``, scripts/setup.sh) and a checkout copy
  nothing: ``kernels.cuda_source_dir()`` falls back to the repository's ``cuda/``.

Nothing is written into client/ itself (.gitignore keeps client/kvtier_client/cuda/ out).
Everything else about the build is in pyproject.toml.
"""
from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

CUDA_SOURCES = Path(__file__).resolve().parent.parent / "cuda"
PACKAGE_CUDA = Path("kvtier_client") / "cuda"


def _cuda_files() -> list[Path]:
    return sorted(CUDA_SOURCES.glob("*.cu"))


def _check(target: Path) -> None:
    """A package without its kernels would fail only at the first GPU call: fail the build."""
    if not (target / "page_copy.cu").is_file():
        raise FileNotFoundError(f"no CUDA sources for kvtier_client: {CUDA_SOURCES}/*.cu is missing (build from the repository)")


class BuildPyWithCuda(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the package stays in client/; kernels.py finds ../cuda itself
            return
        target = Path(self.build_lib) / PACKAGE_CUDA
        self.mkpath(str(target))
        for source in _cuda_files():
            self.copy_file(str(source), str(target / source.name))
        _check(target)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if self.editable_mode else [str(Path(self.build_lib) / PACKAGE_CUDA / s.name) for s in _cuda_files()]
        return sorted(set(super().get_outputs(include_bytecode)) | set(extra))


class SdistWithCuda(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        target = Path(base_dir) / PACKAGE_CUDA
        self.mkpath(str(target))
        for source in _cuda_files():
            self.copy_file(str(source), str(target / source.name))
        _check(target)


setup(cmdclass={"build_py": BuildPyWithCuda, "sdist": SdistWithCuda})
