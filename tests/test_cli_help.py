"""Every job's ``--help``: each module under jobs/ exposes ``build_parser()``; the parser has a description
and every argument (but -h) one line of help that states its default (NZ and MTP included)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re

import pytest

import jobs

JOBS = sorted(m.name for m in pkgutil.iter_modules(jobs.__path__) if not m.name.startswith("_"))  # _x: shared code


def parser_of(name: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"jobs.{name}")
    assert hasattr(module, "build_parser"), f"jobs.{name} has no build_parser()"
    return module.build_parser()


def states_default(ap: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """The help says what happens without the argument (a required one has no default to state)."""
    if action.required:
        return True
    if isinstance(ap.formatter_class, type) and issubclass(ap.formatter_class, argparse.ArgumentDefaultsHelpFormatter):
        return True
    text = action.help.lower()
    flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
    return "default" in text or (flag and "off" in text)


def test_there_are_jobs():
    assert {"chat", "generate", "plan", "serve", "quantize", "requantize", "check", "evaluate"} <= set(JOBS)


@pytest.mark.parametrize("name", JOBS)
def test_every_option_has_help_and_its_default(name):
    ap = parser_of(name)
    assert (ap.description or "").strip(), f"jobs.{name}: no description"
    bad = []
    for a in ap._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        label = "/".join(a.option_strings) or a.dest
        if not (a.help or "").strip() or a.help == argparse.SUPPRESS:
            bad.append(f"{label}: no help")
        elif not states_default(ap, a):
            bad.append(f"{label}: no default in {a.help!r}")
    assert bad == [], f"jobs.{name}: " + "; ".join(bad)


@pytest.mark.parametrize("name", JOBS)
def test_help_renders(name, capsys):
    with pytest.raises(SystemExit) as e:
        parser_of(name).parse_args(["--help"])
    assert e.value.code == 0
    assert "default" in capsys.readouterr().out


def test_serve_states_the_nz_and_mtp_defaults():
    from actors.serving.serve_config import DEFAULT_ENGINE

    helps = {a.dest: a.help for a in parser_of("serve")._actions}
    assert re.search(r"\(default: (on|off)\)", helps["nz"]).group(1) == ("on" if DEFAULT_ENGINE.nz else "off")
    assert re.search(r"\(default: (on|off)\)", helps["mtp"]).group(1) == ("on" if DEFAULT_ENGINE.mtp else "off")
