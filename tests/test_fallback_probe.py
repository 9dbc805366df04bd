"""--fa-fallback / --linear-fallback checked before any work, and the probe they quantize: a hidden sibling
of the destination (never $TMPDIR), removed on SIGTERM, swept by the next run after a SIGKILL. The
measuring itself is tests/test_fallback.py's; here it is replaced by stand-ins that stop the job where
the test looks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from jobs import quantize as quantize_job
from pipeline.quant.evaluation.fallback import job as fallback
from pipeline.quant.numerics.qparams import QuantError
from tiny import FIXTURES, TINY_FIXTURE

DATA_FREE = ["--dynamic", "--no-fa-quant", "--disable-anti"]


def run(capsys, dst: Path, *args: str) -> tuple[int, str, str]:
    rc = quantize_job.main(["--no-progress", "--no-estimate", "--model-path", str(TINY_FIXTURE), "--save-path",
                            str(dst), *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_probe(monkeypatch):
    """Fail the test if anything is quantized."""
    import pipeline.quant.job.run as run_mod

    def refuse(*a, **k):
        raise AssertionError("a probe or output was quantized")
    monkeypatch.setattr(run_mod, "quantize_checkpoint", refuse)


FA3_RECIPE = ["--config-path", str(FIXTURES / "recipe-w8a8-fa3.yaml")]     # FA3 on every layer, MTP quantized


@pytest.mark.parametrize("args, message", [
    (["--fa-fallback", "5", *FA3_RECIPE], "--fa-fallback 5: the recipe quantizes only 4 FA3 layers"),
    (["--linear-fallback", "34", *FA3_RECIPE], "--linear-fallback 34: the recipe quantizes only 33 linears"),
    (["--fa-fallback", "2", *DATA_FREE], "--fa-fallback 2: the recipe has nothing to keep (no layer has FA3)"),
    (["--fa-fallback", "auto"], "--fa-fallback auto: the recipe has nothing to keep (no layer has FA3)"),
])
def test_what_the_recipe_cannot_give_is_refused_before_the_probe(capsys, tmp_path, no_probe, args, message):
    rc, out, err = run(capsys, tmp_path / "q", *args)
    assert rc == 2 and err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_the_piece_counts_come_from_the_recipe_and_config():
    from pipeline.config import DeepseekV3Config
    from pipeline.quant.recipe.recipe import Recipe
    from tiny import tiny_config

    cfg = DeepseekV3Config.from_dict(tiny_config())
    # FA3 on each main layer; linear pieces per layer: the q_a/kv_a pair, q_b_proj, o_proj (kv_b_proj stays
    # float), then layer 0's dense gate/up/down, or a MoE layer's 3 expert groups and 3 shared-expert linears
    assert fallback.pieces(Recipe(), cfg) == (3, 3 + 3 + 2 * (3 + 6))
    assert fallback.pieces(Recipe(fa_quant=False, quantize_mtp=True), cfg)[0] == 0
    assert fallback.pieces(Recipe(quantize_mtp=True), cfg) == (4, 3 + 3 + 3 * (3 + 6))   # the MTP layer: MoE
    with pytest.raises(QuantError, match="only 3 FA3 layers"):
        fallback.check_choices(Recipe(), cfg, 4, None)
    assert fallback.check_choices(Recipe(), cfg, 0, 0) == (None, None)


def test_zero_is_none_and_runs_no_probe(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(fallback, "choose", lambda *a, **k: pytest.fail("a probe was measured"))
    rc, out, err = run(capsys, tmp_path / "q", "--fa-fallback", "0", "--linear-fallback", "0", *DATA_FREE)
    assert rc == 0, err
    assert not (tmp_path / "q" / "fallback.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_sigterm_during_the_probe_removes_it_and_says_so(capsys, tmp_path, monkeypatch):
    seen: list[str] = []

    def terminate(src, probe, *a, **k):
        seen.append(probe)
        assert Path(probe, "quant_model_description.json").exists()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):                     # the handler runs at the next bytecode
            time.sleep(0.01)
        pytest.fail("SIGTERM did not stop the job")
    monkeypatch.setattr(fallback, "choose", terminate)
    before = signal.getsignal(signal.SIGTERM)
    rc, out, err = run(capsys, tmp_path / "q", "--linear-fallback", "1", *DATA_FREE)
    assert rc == 143 and "stopped: SIGTERM" in err, err
    assert seen and Path(seen[0]).parent == tmp_path and Path(seen[0]).name.startswith(".q.fallback-probe-")
    assert list(tmp_path.iterdir()) == []         # no probe, no lock, no output
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_next_run_sweeps_what_a_killed_run_left(capsys, tmp_path, monkeypatch):
    stale = tmp_path / ".q.fallback-probe-0123456789ab"
    stale.mkdir()
    (stale / "quant_model_weights-00001-of-00001.safetensors").write_bytes(b"x" * 64)
    (tmp_path / "..q.fallback-probe-0123456789ab.dsquant-lock").write_text("{}")
    (tmp_path / ".other.fallback-probe-0123456789ab").mkdir()      # another destination's: kept

    def stop(*a, **k):
        raise QuantError("stopped here by the test")
    monkeypatch.setattr(fallback, "choose", stop)
    rc, out, err = run(capsys, tmp_path / "q", "--linear-fallback", "1", *DATA_FREE)
    assert rc == 2 and "stopped here by the test" in err
    assert "removed 2 probe file(s)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.fallback-probe-0123456789ab"]
