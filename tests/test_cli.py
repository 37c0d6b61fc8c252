"""The ``transformer-jax`` command: one dispatcher, every subcommand's ``--help`` in one style,
the console scripts declared, and unknown commands refused."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from transformer_jax import cli

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"\n  {name} " in out


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_help_under_the_one_program_name(name, capsys):
    try:
        status = cli.main([name, "--help"])
    except SystemExit as e:  # argparse's --help
        status = e.code
    assert status == 0
    out = capsys.readouterr().out
    assert out.strip()
    if name != "bench":
        assert out.startswith(f"usage: {cli.PROG} {name}"), out[:200]
    else:
        assert out.startswith(f"usage: {cli.PROG} bench")


def test_an_unknown_or_missing_command_is_exit_status_2(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "usage:" in capsys.readouterr().err


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"{cli.PROG} ")


def test_the_console_scripts_point_at_the_dispatcher():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"transformer-jax": "transformer_jax.cli:console",
                       "tjax": "transformer_jax.cli:console"}
    module, _, function = scripts["tjax"].partition(":")
    assert module == cli.__name__ and callable(getattr(cli, function))


def test_a_subcommand_gets_the_rest_of_the_arguments(monkeypatch):
    from transformer_jax.cli import plot

    seen = []
    monkeypatch.setattr(plot, "main", lambda argv: seen.append(argv) or 3)
    assert cli.main(["plot", "runs/a", "--out", "x.png"]) == 3
    assert seen == [["runs/a", "--out", "x.png"]]
