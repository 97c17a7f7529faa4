"""The installed package holds every module of the source tree (meson installs only what it
lists)."""
import importlib
import pathlib
import pkgutil

import strata

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "strata"


def _source_modules() -> set[str]:
    names = set()
    for path in SRC.rglob("*"):
        if path.suffix not in (".py", ".pyx") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.add(".".join(parts))
    return names


def _installed_modules() -> set[str]:
    names = {"strata"}
    for info in pkgutil.walk_packages(strata.__path__, "strata."):
        names.add(info.name)
    return names


def test_every_source_module_is_installed():
    missing = _source_modules() - _installed_modules()
    assert not missing, f"not installed (add them to their folder's meson.build): {sorted(missing)}"


def test_every_module_imports():
    for name in sorted(_installed_modules()):
        if name.endswith("__main__"):
            continue
        importlib.import_module(name)


def test_data_files_are_installed():
    data = pathlib.Path(strata.__file__).parent / "data"
    for path in (SRC / "data").iterdir():
        if path.is_file() and path.suffix != ".py" and path.name != "meson.build":
            assert (data / path.name).is_file(), f"{path.name} is not installed"


def test_python_dash_m_runs_both_commands():
    """`python -m strata` and `python -m strata.tool`: where pip put no console scripts on PATH
    (pip --target into a folder that has a bin/ already, as on the GPU machine)."""
    import subprocess
    import sys

    for module, words in (("strata", "run"), ("strata.tool", "calibrate")):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert words in done.stdout
