"""The package layout promises of DESIGN.md §1, checked."""

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_operator_directory_does_not_shadow_the_standard_library() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "engine" / "__init__.py").exists()
    import operator

    assert hasattr(operator, "itemgetter"), "stdlib operator module was shadowed"


def test_cli_help_lists_commands_without_importing_torch_or_kopf() -> None:
    code = (
        "import sys; from kvfleet_cli.main import main; main(['--help']);"
        "assert 'torch' not in sys.modules and 'kopf' not in sys.modules, sorted(sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: kvfleet" in proc.stdout


def test_unknown_command_exits_2_with_usage() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet_cli", "no-such-command"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "unknown command 'no-such-command'" in proc.stderr


def test_every_subcommand_target_exists() -> None:
    from kvfleet_cli.main import SUBCOMMANDS

    for name, (target, _) in SUBCOMMANDS.items():
        module_name, func_name = target.split(":")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, func_name)), name


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules of tests/ and e2e/ (no __init__.py) by their basename: two
    files with one name stop the whole run at collection."""
    seen: dict[str, Path] = {}
    for path in sorted([*ROOT.glob("tests/**/test_*.py"), *ROOT.glob("e2e/**/test_*.py")]):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a module name"
        seen[path.name] = path
