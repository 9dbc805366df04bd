"""The serving and generation jobs refuse bad flags and files with one line, before Ray or a model starts:
a --port something listens on, an unknown --device or CUDA without it, an API key file that cannot be
used, --config / --mindie-config nested too deeply or not UTF-8, MindIE keys it does not know (and a
warning for MindIE's keys that do not apply here), a prompt that is not UTF-8; and an object store that
accepts connections but never answers is given up on in seconds, saying so while it retries."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import FIXTURES, TINY_FIXTURE

REPO = Path(__file__).resolve().parents[1]


def serve(capsys, *args) -> tuple[int, str]:
    from jobs import serve as serve_job

    rc = serve_job.main(["--model-path", str(TINY_FIXTURE), *args])
    return rc, capsys.readouterr().err


def one_line(err: str, *needles: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_a_busy_port_is_one_line_before_ray_starts(capsys):
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as s:
            s.bind((host, 0))
            s.listen(1)
            port = s.getsockname()[1]
            rc, err = serve(capsys, "--host", host, "--port", str(port))
        assert rc == 2 and "ray:" not in err
        one_line(err, f"--port {port}", "is in use")
    rc, err = serve(capsys, "--port", "70000")
    assert rc == 2
    one_line(err, "--port must be in 1..65535, got 70000")


@pytest.mark.parametrize("host, says", [("999.1.1.1", "not an address or a name this machine resolves"),
                                        ("nosuch.invalid", "not an address or a name this machine resolves"),
                                        ("192.0.2.1", "not an address of this machine")])
def test_a_host_this_machine_cannot_listen_on_names_host(capsys, host, says):
    rc, err = serve(capsys, "--host", host, "--port", "8000")
    assert rc == 2 and "ray:" not in err
    one_line(err, f"--host {host}: {says}")


def test_devices_this_machine_cannot_run_on_are_one_line(capsys):
    import torch

    rc, err = serve(capsys, "--device", "tpu")
    assert rc == 2
    one_line(err, "--device 'tpu': not a device this project runs on")
    rc, err = serve(capsys, "--device", f"cuda:{torch.cuda.device_count() + 3}")
    assert rc == 2
    one_line(err, "--device cuda:")
    from jobs import quantize as quantize_job

    assert quantize_job.main(["--device", "npu", "--save-path", "/nonexistent/q"]) == 2
    one_line(capsys.readouterr().err, "--device 'npu'")


def test_the_api_key_from_a_file_or_the_environment_and_the_flag_warns(tmp_path, monkeypatch):
    from jobs._serve_flags import api_key, parse_args

    key = tmp_path / "key"
    key.write_text("sk-file\nignored\n")
    assert api_key(parse_args(["--api-key-file", str(key)])) == "sk-file"
    monkeypatch.setenv("DSQUANT_API_KEY", "sk-env")
    assert api_key(parse_args([])) == "sk-env" and api_key(parse_args(["--api-key", "sk-flag"])) == "sk-flag"
    (tmp_path / "empty").write_text("\n")
    for args, message in ((["--api-key-file", str(tmp_path / "nope")], "cannot read it"),
                          (["--api-key-file", str(tmp_path / "empty")], "its first line is empty"),
                          (["--api-key", "a", "--api-key-file", str(key)], "not both")):
        with pytest.raises(ValueError, match=message):
            api_key(parse_args(args))


def test_api_key_flag_warns_that_it_shows_in_ps(capsys, tmp_path):
    rc, err = serve(capsys, "--api-key", "sk-visible", "--device", "tpu")
    assert rc == 2 and err.startswith("warning: --api-key is visible to every user")


def test_config_files_nested_too_deeply_or_not_utf8_are_one_line(capsys, tmp_path):
    deep_json = tmp_path / "deep.json"
    deep_json.write_text("[" * 200_000 + "]" * 200_000)
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("a: " + "[" * 200_000)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe{}")
    for flag, path, why in (("--mindie-config", deep_json, "nested too deeply"), ("--config", deep_json, "nested too deeply"),
                            ("--config", deep_yaml, "nested too deeply"), ("--mindie-config", binary, "not UTF-8")):
        rc, err = serve(capsys, flag, str(path))
        assert rc == 2
        one_line(err, str(path), why)


def test_mindie_keys_unknown_are_refused_and_those_that_do_not_apply_warned(capsys, tmp_path):
    from pipeline.serving.mindie_config import parse_mindie_model_config

    entry = {"modelName": "m", "modelWeightPath": str(TINY_FIXTURE), "worldSize": 1}
    with pytest.raises(ValueError, match=r"^ModelConfig has unknown key\(s\) tensorParallel, wordSize: MindIE's"):
        parse_mindie_model_config({"ModelConfig": [{**entry, "wordSize": 1, "tensorParallel": 2}]}, 1, cpu=True)
    cfg = parse_mindie_model_config({"ModelConfig": [{**entry, "npuMemSize": -1, "backendType": "atb"}]}, 1, cpu=True)
    assert "ModelConfig.npuMemSize does not apply to this engine and is ignored" in cfg.warnings
    block = tmp_path / "mindie.json"
    block.write_text(json.dumps({"ModelConfig": [{**entry, "cpuMemSize": 5}]}))
    rc, err = serve(capsys, "--mindie-config", str(block), "--device", "tpu")   # stops after reading it
    assert rc == 2 and "warning: --mindie-config: ModelConfig.cpuMemSize does not apply" in err


def test_a_prompt_that_is_not_utf8_is_one_line():
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    for argv, needle in (([b"\xff\xfe hello"], "the prompt is not valid UTF-8: byte 0xff at character 0"),
                         ([b"hi", b"--device", b"tpu"], "--device 'tpu'")):
        r = subprocess.run([sys.executable, "-m", "jobs.generate", *argv], cwd=REPO, env=env, capture_output=True,
                           timeout=300)
        err = r.stderr.decode(errors="replace")
        assert r.returncode == 2, err
        one_line(err, needle)


@pytest.fixture
def mute_endpoint():
    """An HTTP endpoint that accepts connections (the kernel does) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_a_mute_object_store_is_given_up_on_in_seconds_saying_so(capsys, monkeypatch, mute_endpoint, tmp_path):
    from jobs import plan as plan_job
    from jobs import quantize as quantize_job
    from pipeline.io import storage

    monkeypatch.setattr(storage, "PROBE_TIMEOUT_S", 0.5)   # a mute endpoint never answers: any bound shows it
    saved = storage.options().get("s3")                    # the session's S3 server's, when one runs
    lines: list[str] = []
    try:
        storage.set_options("s3", client_kwargs={"endpoint_url": mute_endpoint})
        with pytest.raises(storage.StorageError) as e:
            storage.check_reachable("s3://bucket/out", log=lines.append)
        rc = quantize_job.main(["--no-progress", "--model-path", str(TINY_FIXTURE), "--save-path", "s3://bucket/q",
                                "--calib-data", str(FIXTURES / "calib.json"), "--s3-endpoint", mute_endpoint])
        out, err = capsys.readouterr()
        rc_plan = plan_job.main(["--model-path", "s3://bucket/src"])
    finally:
        storage._OPTIONS.pop("s3", None)
        if saved is not None:
            storage.set_options("s3", **saved)
    assert str(e.value) == (f"s3://bucket/out: storage not reachable at {mute_endpoint} (it accepted a connection "
                            f"but sent no answer within 0.5 s; tried {storage.PROBE_ATTEMPTS} times)")
    assert lines == [f"storage: {mute_endpoint} did not answer (it accepted a connection but sent no answer within "
                     f"0.5 s); retrying ({i} of {storage.PROBE_ATTEMPTS})" for i in range(2, storage.PROBE_ATTEMPTS + 1)]
    assert rc == 2 and "calibrating" not in out
    assert err.count("retrying") == storage.PROBE_ATTEMPTS - 1
    assert err.strip().splitlines()[-1].startswith(f"error: s3://bucket/q: storage not reachable at {mute_endpoint}")
    out, err = capsys.readouterr()
    assert rc_plan == 2 and out == "" and err.count("retrying") == storage.PROBE_ATTEMPTS - 1
    assert err.strip().splitlines()[-1].startswith(f"error: s3://bucket/src: storage not reachable at {mute_endpoint}")
