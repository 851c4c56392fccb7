"""The command line explains itself: every flag's help shows its default, `serve --help` is grouped, `-v` logs one
line per served turn, and a start-up mistake is one line naming the flag, exit status 2, before the model loads."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import warnings

import pytest
from fastapi.testclient import TestClient

import hf_attnstore.lab.models
from hf_attnstore import AttnStore
from hf_attnstore.cli import _HelpFormatter, build_parser, build_server, main
from hf_attnstore.lab.redis_server import free_port


def options(parser: argparse.ArgumentParser, name: str = "attnstore"):
    """(command, flag, action) for every option of every command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from options(subparser, f"{name} {sub}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield name, action.option_strings[-1], action


def test_every_flag_has_help_that_shows_its_default():
    missing = []
    for command, flag, action in options(build_parser()):
        text = _HelpFormatter(command)._get_help_string(action)
        if not action.help or not ("default" in text.lower() or "required" in text):
            missing.append(f"{command} {flag}")
    assert not missing, missing


def test_serve_help_is_grouped_and_prints_the_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.index("everyday:") < text.index("tiers:") < text.index("tuning:")
    for default in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 2GiB)", "(default: 100GiB)",
                    "(default: float32)", "(default: lookahead)", "(default: 256)", "(default: 8)"):
        assert default in " ".join(text.split()), default


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if anything tries to load a model: the mistakes below must be found before."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was found")

    monkeypatch.setattr(hf_attnstore.lab.models, "load_default_model", load)


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags, flag", [
    (["--disk-dir", "/proc/nonexistent/kv"], "--disk-dir"),
    (["--disk-dir", "/sys/attnstore-kv"], "--disk-dir"),
    (["--model", "/nonexistent/model"], "--model"),
    (["--kv-codec", "int8"], "--kv-codec"),  # a lossy codec without a tier below host memory
    (["--chat-template", "/nonexistent/template.jinja"], "--chat-template"),
])
def test_a_start_up_mistake_is_one_line_naming_the_flag(flags, flag, no_model, capsys):
    assert main(["serve", *flags]) == 2
    assert flag in one_line(capsys)


@pytest.mark.parametrize("flag, value", [("--host-bytes", "abc"), ("--disk-bytes", "12XB"), ("--max-batch-kv", "lots")])
def test_a_bad_size_is_refused_when_the_command_line_is_read(flag, value, no_model, capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", flag, value])
    assert done.value.code == 2
    err = one_line(capsys)
    assert f"argument {flag}: {value!r} is not a byte size" in err


@pytest.mark.parametrize("value, words", [
    ('{"presence": 0.5}', "presence: Extra inputs are not permitted"),
    ('{"top_p": 0}', "top_p: Input should be greater than 0"),
    ('{"top_k": true}', "top_k: Input should be a valid integer"),
    ("[0.5]", "give an object of sampling fields, not list"),
    ("presence_penalty=0.5", "not JSON"),
])
def test_bad_sampling_defaults_are_refused_when_the_command_line_is_read(value, words, no_model, capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--sampling-defaults", value])
    assert done.value.code == 2
    err = one_line(capsys)
    assert "argument --sampling-defaults: " in err and words in err, err


def test_a_locked_disk_dir_and_a_dead_required_remote_are_one_line(tmp_path, no_model, capsys):
    with AttnStore(host_bytes="1MiB", disk_dir=str(tmp_path)):
        assert main(["serve", "--disk-dir", str(tmp_path)]) == 2
        err = one_line(capsys)
        assert err.startswith("attnstore serve: error: ") and "in use by another AttnStore" in err
        assert "`--disk-dir`" in err
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["serve", "--remote", dead, "--remote-required"]) == 2
    assert one_line(capsys).startswith(f"attnstore serve: error: --remote: the remote tier {dead} cannot be reached")
    assert main(["chat", "--disk-dir", "/proc/nonexistent/kv"]) == 2  # chat checks the same way
    assert "--disk-dir" in one_line(capsys)


def test_a_model_that_cannot_be_found_is_one_line_naming_model(capsys):
    assert main(["serve", "--model", "nobody/no-such-model-here"]) == 2  # offline: not on disk, not in the Hub cache
    assert one_line(capsys).startswith("attnstore serve: error: --model: cannot load 'nobody/no-such-model-here'")


def test_the_installed_command_prints_one_line_and_exits_2():
    done = subprocess.run([sys.executable, "-m", "hf_attnstore", "serve", "--disk-dir", "/proc/nonexistent/kv"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "`--disk-dir` '/proc/nonexistent/kv'" in done.stderr, done.stderr


def test_verbose_serve_logs_one_line_per_turn(model_dir, caplog, tmp_path):
    args = build_parser().parse_args(["-v", "serve", "--model", model_dir, "--max-tokens", "3", "--disk-dir",
                                      str(tmp_path / "kv"), "--max-batch-kv", "64MiB"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the server passes every option the current way
        server = build_server(args)
    messages = [{"role": "user", "content": "why is the sky blue?"}]
    try:
        with TestClient(server.app) as client, caplog.at_level(logging.INFO, logger="hf_attnstore.turns"):
            for _ in range(2):
                r = client.post("/v1/chat/completions", json={"model": server.name, "messages": messages,
                                                              "temperature": 0, "user": "ann"})
                assert r.status_code == 200, r.text
                messages = messages + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                                       {"role": "user", "content": "and at night?"}]
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_attnstore.turns"]
    assert len(lines) == 2, lines
    assert "kv miss, reused 0," in lines[0] and "kv host, reused" in lines[1] and "reused 0," not in lines[1], lines
    assert all("prefilled" in line and "TTFT" in line and "generated 3 tokens" in line for line in lines), lines
